"""The x-session-affinity table: sticks while the worker is there and not overloaded, bounded,
expiring."""

from __future__ import annotations

import grpc

from services.gateway.routing.affinity import OVERLOAD_SLACK_TOKENS, AffinityTable
from services.gateway.routing.endpoints import Endpoint


def endpoint(name: str, load: int = 0) -> Endpoint:
    e = Endpoint(name, "both", grpc.insecure_channel("127.0.0.1:1"), healthy=True)
    e.in_flight_decode_tokens = load
    return e


def test_a_session_returns_to_its_worker_until_it_is_gone_or_overloaded():
    a, b = endpoint("a"), endpoint("b")
    table = AffinityTable()
    assert table.lookup("both", "s", [a, b]) is None  # new session: the policy decides
    table.remember("both", "s", a)
    assert table.lookup("both", "s", [a, b]) is a
    assert table.lookup("prefill", "s", [a, b]) is None  # per role
    assert table.lookup("both", "s", [b]) is None  # its worker left the candidates
    a.in_flight_decode_tokens = 10 * OVERLOAD_SLACK_TOKENS
    assert table.lookup("both", "s", [a, b]) is None  # overloaded: the policy decides again
    assert (table.num_hits, table.num_misses) == (1, 4)


def test_the_table_is_bounded_and_idle_sessions_expire():
    now = [0.0]
    table = AffinityTable(max_sessions=2, ttl_s=10, clock=lambda: now[0])
    a = endpoint("a")
    for session in ("s1", "s2", "s3"):
        table.remember("both", session, a)
    # the least recently used went
    assert len(table) == 2 and table.lookup("both", "s1", [a]) is None
    now[0] = 11
    assert table.lookup("both", "s3", [a]) is None  # idle past the TTL
    table.remember("both", "s4", a)
    assert len(table) == 1
