"""The balancing policies on endpoints with known loads (no processes)."""

from __future__ import annotations

import grpc

import services  # noqa: F401
from services.gateway.routing import load as balancer
from services.gateway.endpoints import Endpoint


def endpoint(name: str, role: str, prefill: int = 0, decode: int = 0, free_blocks: int = 100, routed: int = 0):
    e = Endpoint(name, role, grpc.insecure_channel("127.0.0.1:1"), healthy=True, num_free_blocks=free_blocks)
    e.in_flight_prefill_tokens, e.in_flight_decode_tokens, e.num_routed = prefill, decode, routed
    return e


def test_prefill_goes_to_the_fewest_queued_prompt_tokens_and_skips_excluded():
    a, b, c = endpoint("a", "prefill", prefill=4000), endpoint("b", "prefill", prefill=10), endpoint("c", "prefill", prefill=300)
    assert balancer.pick_prefill([a, b, c]) is b
    assert balancer.pick_prefill([a, b, c], exclude=(b,)) is c
    assert balancer.pick_prefill([a], exclude=(a,)) is None


def test_decode_needs_room_for_the_prompt_then_the_fewest_decode_tokens():
    full = endpoint("full", "decode", decode=0, free_blocks=1)
    busy = endpoint("busy", "decode", decode=5000, free_blocks=100)
    light = endpoint("light", "decode", decode=200, free_blocks=100)
    assert balancer.pick_decode([full, busy, light], num_prompt_tokens=64) is light
    assert balancer.pick_decode([full, busy], num_prompt_tokens=64) is busy
    # Nobody has room: the one with the most free blocks (it may still refuse).
    assert balancer.pick_decode([full, endpoint("less", "decode", free_blocks=0)], num_prompt_tokens=10_000) is full


def test_colocated_counts_both_kinds_and_ties_alternate():
    a, b = endpoint("a", "both", prefill=100, decode=100), endpoint("b", "both", decode=150)
    assert balancer.pick_colocated([a, b]) is b
    x, y = endpoint("x", "both", routed=3), endpoint("y", "both", routed=2)
    assert balancer.pick_colocated([x, y]) is y


def test_in_flight_load_counts_until_closed_once():
    from services.gateway.endpoints import EndpointSet
    endpoints = EndpointSet({})
    e = endpoint("d", "decode")
    load = endpoints.in_flight(e, prefill_tokens=30)
    assert (e.in_flight_prefill_tokens, e.num_in_flight, e.num_routed) == (30, 1, 1)
    load.move_to_decode(100)
    assert (e.in_flight_prefill_tokens, e.in_flight_decode_tokens) == (0, 100)
    load.close()
    load.close()  # a retry path and a finally may both close it
    assert (e.in_flight_prefill_tokens, e.in_flight_decode_tokens, e.num_in_flight) == (0, 0, 0)
