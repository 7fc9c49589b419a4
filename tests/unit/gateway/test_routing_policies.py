"""The routing policies on endpoints with known loads and caches (no processes)."""

from __future__ import annotations

import grpc

from services.gateway.routing.endpoints import Endpoint
from services.gateway.routing.policies import load


def endpoint(
    name: str, role: str, prefill: int = 0, decode: int = 0, free_blocks: int = 100, routed: int = 0
):
    e = Endpoint(
        name, role, grpc.insecure_channel("127.0.0.1:1"), healthy=True, num_free_blocks=free_blocks
    )
    e.in_flight_prefill_tokens, e.in_flight_decode_tokens, e.num_routed = prefill, decode, routed
    return e


def test_prefill_goes_to_the_fewest_queued_prompt_tokens_and_skips_excluded():
    a, b, c = (
        endpoint("a", "prefill", prefill=4000),
        endpoint("b", "prefill", prefill=10),
        endpoint("c", "prefill", prefill=300),
    )
    assert load.pick_prefill([a, b, c]) is b
    assert load.pick_prefill([a, b, c], exclude=(b,)) is c
    assert load.pick_prefill([a], exclude=(a,)) is None


def test_decode_needs_room_for_the_prompt_then_the_fewest_decode_tokens():
    full = endpoint("full", "decode", decode=0, free_blocks=1)
    busy = endpoint("busy", "decode", decode=5000, free_blocks=100)
    light = endpoint("light", "decode", decode=200, free_blocks=100)
    assert load.pick_decode([full, busy, light], num_prompt_tokens=64) is light
    assert load.pick_decode([full, busy], num_prompt_tokens=64) is busy
    # Nobody has room: the one with the most free blocks (it may still refuse).
    assert (
        load.pick_decode(
            [full, endpoint("less", "decode", free_blocks=0)], num_prompt_tokens=10_000
        )
        is full
    )


def test_colocated_counts_both_kinds_and_ties_alternate():
    a, b = endpoint("a", "both", prefill=100, decode=100), endpoint("b", "both", decode=150)
    assert load.pick_colocated([a, b]) is b
    x, y = endpoint("x", "both", routed=3), endpoint("y", "both", routed=2)
    assert load.pick_colocated([x, y]) is y


def test_in_flight_load_counts_until_closed_once():
    from services.gateway.routing.endpoints import EndpointSet

    endpoints = EndpointSet({})
    e = endpoint("d", "decode")
    load = endpoints.in_flight(e, prefill_tokens=30)
    assert (e.in_flight_prefill_tokens, e.num_in_flight, e.num_routed) == (30, 1, 1)
    load.move_to_decode(100)
    assert (e.in_flight_prefill_tokens, e.in_flight_decode_tokens) == (0, 100)
    load.close()
    load.close()  # a retry path and a finally may both close it
    assert (e.in_flight_prefill_tokens, e.in_flight_decode_tokens, e.num_in_flight) == (0, 0, 0)


def test_kv_prefers_the_cached_prefix_until_its_queue_outweighs_it():
    from services.gateway.routing.policies import RouteRequest
    from services.gateway.routing.policies.kv import KVPolicy
    from services.gateway.routing.prefix_index import PrefixIndex

    index = PrefixIndex()
    holder, other = endpoint("holder", "both"), endpoint("other", "both")
    index.stored(holder, [1, 2, 3, 4])  # 64 tokens of the prompt's 100
    policy = KVPolicy(index)
    request = RouteRequest(num_prompt_tokens=100, max_tokens=10, block_hashes=[1, 2, 3, 4, 5, 6])
    route = policy.pick("both", request, [other, holder])
    assert (route.endpoint, route.reason, route.num_cached_tokens) == (holder, "cache", 64)
    # its queue, at half a token a token, now costs more than the cache saves (64)
    holder.in_flight_prefill_tokens = 129
    route = policy.pick("both", request, [other, holder])
    assert (route.endpoint, route.reason) == (other, "load")


def test_kv_keeps_the_cached_prefix_on_a_busier_worker_until_the_balance_bound():
    from services.gateway.routing.policies import RouteRequest
    from services.gateway.routing.policies.kv import BALANCE_FACTOR, BALANCE_SLACK, KVPolicy
    from services.gateway.routing.prefix_index import PrefixIndex

    index = PrefixIndex()
    holder, other = endpoint("holder", "both"), endpoint("other", "both")
    index.stored(holder, [1, 2, 3, 4, 5, 6])  # 96 of the prompt's 100 tokens
    policy = KVPolicy(index)
    request = RouteRequest(num_prompt_tokens=100, max_tokens=10, block_hashes=[1, 2, 3, 4, 5, 6])
    other.num_in_flight = 1
    # 6 more requests in flight than the other worker (the old bound, 1.5 x 1 + 2, passed it over),
    # but their prefill queue (10 tokens) is less than what its cache saves (96): it keeps it
    holder.num_in_flight, holder.in_flight_prefill_tokens = 7, 10
    route = policy.pick("both", request, [other, holder])
    assert (route.endpoint, route.reason) == (holder, "cache")
    holder.num_in_flight = int(BALANCE_FACTOR * other.num_in_flight + BALANCE_SLACK) + 1
    route = policy.pick("both", request, [other, holder])
    assert (route.endpoint, route.reason) == (other, "load")  # far busier: passed over anyway


def test_kv_sends_decode_where_the_prompt_fits_and_most_of_it_is_cached():
    from services.gateway.routing.policies import RouteRequest
    from services.gateway.routing.policies.kv import KVPolicy
    from services.gateway.routing.prefix_index import PrefixIndex

    index = PrefixIndex()
    cached, cold, full = (
        endpoint("cached", "decode"),
        endpoint("cold", "decode"),
        endpoint("full", "decode", free_blocks=1),
    )
    index.stored(cached, [1, 2])
    index.stored(full, [1, 2, 3])
    request = RouteRequest(num_prompt_tokens=60, max_tokens=10, block_hashes=[1, 2, 3])
    assert KVPolicy(index).pick("decode", request, [cold, full, cached]).endpoint is cached


def test_kv_counts_blocks_loadable_from_the_store_cheaper_than_computing_dearer_than_local():
    from services.gateway.routing.policies import RouteRequest
    from services.gateway.routing.policies.kv import KVPolicy
    from services.gateway.routing.prefix_index import PrefixIndex

    index = PrefixIndex()
    local, other = endpoint("local", "both"), endpoint("other", "both")
    index.stored(local, [1, 2])  # 2 blocks here; the store holds 4, the first 2 in DRAM, 2 on disk
    request = RouteRequest(
        num_prompt_tokens=100,
        max_tokens=10,
        block_hashes=[1, 2, 3, 4, 5, 6],
        stored_tiers=["dram", "dram", "disk", "disk"],
    )
    policy = KVPolicy(index)
    route = policy.pick("both", request, [other, local])
    assert (route.endpoint, route.reason, route.num_cached_tokens) == (local, "cache", 64)
    # local: 36 computed + 2 disk blocks x 0.75 x 16 = 60; other: 36 + 2 x 0.25 x 16 + 2 x 0.75 x 16 = 68
    # 60 + 0.5 x 17 = 68.5 > 68: the store makes them near-equals
    other.in_flight_prefill_tokens, local.in_flight_prefill_tokens = 0, 17
    assert policy.pick("both", request, [other, local]).endpoint is other
    without_store = RouteRequest(
        num_prompt_tokens=100, max_tokens=10, block_hashes=[1, 2, 3, 4, 5, 6]
    )
    assert policy.pick("both", without_store, [other, local]).endpoint is local  # 68 + 8.5 < 100


def full_cache(index, e, num_blocks: int, first_hash: int) -> None:
    """`e`'s KV pool of `num_blocks`, every block holding some other prompt's prefix."""
    e.num_blocks = num_blocks
    index.stored(e, range(first_hash, first_hash + num_blocks))


def test_kv_sends_a_new_conversation_to_an_empty_cache_not_the_full_system_prompt_holders():
    from services.gateway.routing.policies import RouteRequest
    from services.gateway.routing.policies.kv import KVPolicy
    from services.gateway.routing.prefix_index import PrefixIndex

    index = PrefixIndex()
    holder, empty = endpoint("holder", "both"), endpoint("empty", "both")
    full_cache(index, holder, 64, first_hash=1000)
    index.stored(holder, [1])  # the system prompt: 16 of the prompt's 100 tokens
    empty.num_blocks = 64
    request = RouteRequest(num_prompt_tokens=100, max_tokens=10, block_hashes=[1, 50, 51, 52, 53])
    route = KVPolicy(index).pick("both", request, [holder, empty])
    # holder: 84 computed + 2 x 1 (full) x 84 pushed out; empty: 100 computed, nothing pushed out
    assert (route.endpoint, route.reason) == (empty, "load")
    empty.num_blocks = holder.num_blocks = 0  # pool sizes unknown: the cached prefix wins
    assert KVPolicy(index).pick("both", request, [holder, empty]).endpoint is holder


def test_kv_keeps_a_prefix_on_its_queued_holder_when_a_copy_elsewhere_would_evict():
    from services.gateway.routing.policies import RouteRequest
    from services.gateway.routing.policies.kv import KVPolicy
    from services.gateway.routing.prefix_index import PrefixIndex

    index = PrefixIndex()
    holder, other = endpoint("holder", "both"), endpoint("other", "both")
    full_cache(index, holder, 64, first_hash=1000)
    full_cache(index, other, 64, first_hash=2000)
    index.stored(holder, [1, 2, 3, 4, 5, 6])  # 96 of the prompt's 100 tokens
    request = RouteRequest(num_prompt_tokens=100, max_tokens=10, block_hashes=[1, 2, 3, 4, 5, 6])
    policy = KVPolicy(index)
    # Its queue (400 tokens) is far longer than what the cache saves (96), but a second copy
    # would push 100 tokens of other prefixes out of a full cache: 4 x 3 + 200 < 100 x 3
    holder.in_flight_prefill_tokens = 400
    route = policy.pick("both", request, [other, holder])
    assert (route.endpoint, route.reason) == (holder, "cache")
    holder.in_flight_prefill_tokens = 600  # 12 + 300 > 300: now the wait outweighs it
    route = policy.pick("both", request, [other, holder])
    assert (route.endpoint, route.reason) == (other, "load")


def test_kv_spreads_a_burst_on_one_cached_prefix_before_any_new_kv_event():
    from services.gateway.routing.endpoints import EndpointSet
    from services.gateway.routing.policies import RouteRequest
    from services.gateway.routing.policies.kv import KVPolicy
    from services.gateway.routing.prefix_index import PrefixIndex

    index, endpoints = PrefixIndex(), EndpointSet({})
    holder, other = endpoint("holder", "both"), endpoint("other", "both")
    holder.max_num_seqs = other.max_num_seqs = 64
    prefix = list(range(1, 21))  # 20 blocks, cached on holder only; no event arrives meanwhile
    index.stored(holder, prefix)
    policy, counts, loads = KVPolicy(index), {"holder": 0, "other": 0}, []
    for _ in range(40):
        request = RouteRequest(num_prompt_tokens=328, max_tokens=60, block_hashes=prefix)
        route = policy.pick("both", request, [holder, other])
        counts[route.endpoint.address] += 1
        loads.append(
            endpoints.in_flight(
                route.endpoint,
                prefill_tokens=328 - route.num_cached_tokens,
                decode_tokens_after_prefill=328 + 60,
                block_hashes=prefix,
            )
        )
    # Each cached request's decode load counts from routing, and the other worker's first
    # request in flight makes it a holder of the prefix too: an even split, by the cost alone
    # (the balance bound, 3 x 8 + 8, would allow 32 against 8).
    assert abs(counts["holder"] - counts["other"]) <= 4, counts
    for in_flight in loads:
        in_flight.close()
    assert not holder.in_flight_blocks and not other.in_flight_blocks
    assert (holder.in_flight_decode_tokens, other.in_flight_decode_tokens) == (0, 0)


def test_in_flight_counts_decode_load_from_routing_only_for_a_prompt_of_at_most_one_block_left():
    from services.gateway.routing.endpoints import EndpointSet

    endpoints, e = EndpointSet({}), endpoint("w", "both")
    cached = endpoints.in_flight(e, prefill_tokens=16, decode_tokens_after_prefill=400)
    assert (e.in_flight_prefill_tokens, e.in_flight_decode_tokens) == (16, 400)
    computing = endpoints.in_flight(e, prefill_tokens=17, decode_tokens_after_prefill=400)
    assert (e.in_flight_prefill_tokens, e.in_flight_decode_tokens) == (33, 400)
    computing.move_to_decode(400)
    cached.move_to_decode(400)
    assert (e.in_flight_prefill_tokens, e.in_flight_decode_tokens) == (0, 800)
