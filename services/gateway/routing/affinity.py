"""`x-session-affinity`: a session's requests go back to the worker that has its prefix.

A client may send `x-session-affinity: <session id>` (HTTP header, or gRPC metadata; REST
through Envoy carries the header as metadata). The table maps (role, session) to the worker
that served the session's last request, at most `max_sessions` entries (the least recently
used go first) and each forgotten after `ttl_s` idle.

A request of a known session goes to the session's worker when that worker is still a candidate
(healthy, not draining) and not overloaded: its in-flight prefill + decode tokens at most
`OVERLOAD_FACTOR` x the mean of the other candidates + `OVERLOAD_SLACK_TOKENS` (so an idle fleet
never counts as overloaded, and a worker alone never does). Otherwise the routing policy decides and
the table follows its choice. It is a strong preference, never a pin that could break the service.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from services.gateway.routing.endpoints import Endpoint

OVERLOAD_FACTOR = 2.0
OVERLOAD_SLACK_TOKENS = 4096


def load(e: Endpoint) -> int:
    return e.in_flight_prefill_tokens + e.in_flight_decode_tokens


class AffinityTable:
    def __init__(self, max_sessions: int = 100_000, ttl_s: float = 1800.0, clock=time.monotonic):
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.clock = clock
        # -> (address, last use)
        self._sessions: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self.num_hits = 0  # requests sent to their session's worker
        self.num_misses = 0  # sessions new, expired, or whose worker was gone or overloaded

    def __len__(self) -> int:
        return len(self._sessions)

    def lookup(self, role: str, session: str, candidates: list[Endpoint]) -> Endpoint | None:
        """The session's worker, if it should get this request."""
        entry = self._sessions.get((role, session))
        now = self.clock()
        if entry is not None and now - entry[1] <= self.ttl_s:
            worker = next((e for e in candidates if e.address == entry[0]), None)
            others = [load(e) for e in candidates if e is not worker]
            mean = sum(others) / len(others) if others else float("inf")
            if (
                worker is not None
                and load(worker) <= OVERLOAD_FACTOR * mean + OVERLOAD_SLACK_TOKENS
            ):
                self.num_hits += 1
                return worker
        self.num_misses += 1
        return None

    def remember(self, role: str, session: str, endpoint: Endpoint) -> None:
        key = (role, session)
        self._sessions[key] = (endpoint.address, self.clock())
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        self._expire()

    def _expire(self) -> None:
        now = self.clock()
        while self._sessions:
            key, (_, used) = next(iter(self._sessions.items()))
            if now - used <= self.ttl_s:
                return
            del self._sessions[key]
