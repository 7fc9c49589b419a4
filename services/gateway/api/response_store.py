"""Past Responses API responses, for `previous_response_id`: bounded and expiring, in the
gateway's memory.

A stored response keeps its conversation as chat messages (what came before it, its own
input and its output), so a follow-up's prompt is that conversation plus its new input; the
earlier `instructions` are not carried over, as OpenAI's API does not carry them. At most
`max_responses` are kept (the oldest go first) for `ttl_s` each, and a
conversation over `max_messages` is not stored (its follow-ups would not fit a context
anyway). A gateway restart forgets them all: an id it does not hold gets a 400, and the
client resends the conversation. With several gateways, a follow-up must reach the one that
stored its predecessor (session affinity at the load balancer).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class StoredResponse:
    messages: list[dict]  # the whole conversation through this response's output, as chat messages
    expires_at: float


class ResponseStore:
    def __init__(
        self,
        max_responses: int = 10_000,
        ttl_s: float = 3600.0,
        max_messages: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self.max_messages = max_messages
        self.clock = clock
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response_id: str, messages: list[dict]) -> bool:
        """Keeps the conversation through `response_id`; False when it is too long to keep."""
        if self.max_responses <= 0 or len(messages) > self.max_messages:
            return False
        self._expire()
        self._responses.pop(response_id, None)
        self._responses[response_id] = StoredResponse(messages, self.clock() + self.ttl_s)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)
        return True

    def get(self, response_id: str) -> list[dict] | None:
        """The conversation through `response_id`, or None when unknown or expired."""
        self._expire()
        stored = self._responses.get(response_id)
        return stored.messages if stored is not None else None

    def _expire(self) -> None:
        """Drops the expired: the oldest first (every entry lives ttl_s from its put)."""
        now = self.clock()
        while self._responses:
            oldest_id, oldest = next(iter(self._responses.items()))
            if oldest.expires_at > now:
                break
            del self._responses[oldest_id]
