"""`kv` (the default): KV-aware routing, the worker with the lowest estimated cost.

For each candidate worker w, from the prefix index (its live KV events), w's KV pool size
(Health) and this gateway's in-flight counts:

    cached(w)    = leading blocks of the prompt that w holds cached, or that a prompt this
                   gateway has in flight on w shares (its KV events have not said so yet,
                   but they will before this one runs), x block_size
    occupancy(w) = blocks w holds cached (the prefix index) / its KV blocks, 0 if unknown
    cost(w) = (prompt_tokens - cached(w))                  what w would have to prefill
            + EVICTION_WEIGHT x occupancy(w)
                          x (prompt_tokens - cached(w))     the cached blocks its new ones push out
            + prefill_weight x in_flight_prefill_tokens(w)  prompt tokens queued ahead
            + decode_weight  x in_flight_decode_tokens(w)   what its running batch reads

with EVICTION_WEIGHT = 2, prefill_weight = 0.5 and decode_weight = 0.25 by default
(`--kv-prefill-weight`, `--kv-decode-weight`). A prompt token costs one token of compute, and
the blocks it adds to w's cache cost more the fuller that cache is: on a full cache each one
evicts a block some later request would have reused, so computing a prefix a second time on
another worker costs up to 3x its compute (both copies hold cache space the fleet could have
used for other prefixes), while a worker with an empty cache pays its compute only. So
- a request stays with the worker holding its prefix unless that worker's queue outweighs the
  saved prefill (x 2 for the queue weight, x 1 to 3 with the cache's occupancy): a prefix is
  computed twice only when waiting for it really costs more;
- a new conversation (only a shared system prompt cached anywhere) goes to a worker with room
  in its cache. Without the term, a worker that held no system prompt cost its few tokens more
  than every holder and, under light load (queues empty), got no request at all, while the
  holders evicted (9 of 32 simulated workers idle on the Mooncake trace).
The queue's weight of 0.5, not 1: a token queued ahead delays this request only, while a
prefix computed twice also takes the compute the worker's later requests wait for.
A token held in a running sequence costs a fraction of one every step (decode_weight). A
request's decode tokens (prompt + max_tokens) count from its first token, or from routing when
at most one block of its prompt is left to compute (the rest cached): it is prefilled in the
step that admits it, so it joins the running batch at once (endpoints.py, `InFlight`). So a
burst sharing one cached prefix spreads by the cost, before any new KV event: each request
adds 0.25 x its context to the holder, and once another worker has one of them in flight, it
counts as holding the prefix too. Without these two rules each request added only its few
uncached tokens and only the balance bound spread the burst (40 requests with a 20-block
system prompt on 2 workers, the holder known before it: 32 against 8; with them 20 against
20 on the real stack, 21 against 19 in bench/cluster_sim.py with no KV event during the burst).

With a KV cache store (`--kv-store`), the stored prefix beyond w's own cached one is loaded,
not computed: those blocks leave the first term and cost (1 - credit) x their tokens, with
credit 0.75 for a block in the store's DRAM and 0.25 on its disk (Dynamo's weights): dearer
than a local hit, cheaper than computing. Loaded blocks take cache slots too (the eviction
term counts them).

The lowest cost wins; ties go to the worker with fewer requests routed so far. A cached prefix
never pulls onto a worker far busier than the rest: a worker with more requests in flight
than BALANCE_FACTOR (3) x the least busy candidate's + BALANCE_SLACK (8) is passed over
while another is not. So a burst sharing one popular prefix fills its holder up to that bound, then
goes to another worker, which builds the prefix too (reason `load` instead of `cache`).
The bound is a backstop, not the balancer: the cost's queue terms already spread load, and a
tighter bound (it was 1.5 x + 2) sent requests away from their prefix while the cost still
favoured it, so the prefix got built twice.
Candidates whose batch is full (as many requests from this gateway as its `max_num_seqs`)
are passed over while others have room.

Measured with bench/cluster_sim.py on the whole Mooncake trace (bench/README.md, issue 27), the
hit ratio as a fraction of one pooled LRU of the fleet's blocks, before the eviction term and
the 0.5 weight -> with them: 4 workers at 0.25 x the trace's arrival times 0.85 -> 0.96, at 0.1 x
0.81 -> 0.95, TTFT p50/p90 unchanged (p90 +2% at 0.1 x); 32 workers 0.91 -> 0.99, requests
max/mean 1.53 -> 1.00. Counting in-flight prompts' blocks and the decode load of cached
requests from routing: 4 workers at 0.25 x 0.96 -> 0.97, at 0.1 x 0.94 -> 0.96; 32 workers and
the synthetic shapes unchanged.

Roles: colocated and prefill workers by this cost. Decode workers: among those whose free
blocks hold the prompt (else `load`'s rule), the lowest
    (prompt_tokens - cached(w)) + decode_weight x in_flight_decode_tokens(w)
where the first term is the KV the prefill worker must send there (a decode worker shares the
blocks it already caches), the second its running batch.
"""

from __future__ import annotations

from services.gateway.routing.endpoints import Endpoint
from services.gateway.routing.policies import load
from services.gateway.routing.policies.base import Policy, Route, RouteRequest

PREFILL_WEIGHT = 0.5
DECODE_WEIGHT = 0.25
EVICTION_WEIGHT = 2.0
STORE_CREDIT = {"dram": 0.75, "disk": 0.25}
BALANCE_FACTOR = 3
BALANCE_SLACK = 8


class KVPolicy(Policy):
    name = "kv"

    def __init__(
        self,
        index=None,
        prefill_weight: float = PREFILL_WEIGHT,
        decode_weight: float = DECODE_WEIGHT,
    ):
        super().__init__(index)
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight

    def pick(self, role: str, request: RouteRequest, candidates: list[Endpoint]) -> Route | None:
        candidates = load.with_room(candidates)
        if role == "decode":
            roomy = [
                e
                for e in candidates
                if e.num_free_blocks * e.block_size >= request.num_prompt_tokens
            ]
            if not roomy:
                endpoint = load.pick_decode(candidates, request.num_prompt_tokens)
                return Route(endpoint, "no_room") if endpoint is not None else None
            candidates = roomy
        matched = (
            self.index.match(request.block_hashes, candidates) if self.index is not None else {}
        )
        # a prompt in flight on w: its blocks are cached there by the time this one runs
        matched = {
            e: max(matched.get(e, 0), e.num_leading_in_flight(request.block_hashes))
            for e in candidates
        }

        def cached(e: Endpoint) -> int:
            return min(matched.get(e, 0) * e.block_size, request.num_prompt_tokens)

        def loaded(e: Endpoint) -> list[str]:
            """The store's tiers of the blocks w would load (past its own cached prefix)."""
            return request.stored_tiers[matched.get(e, 0) :] if role != "decode" else []

        def occupancy(e: Endpoint) -> float:
            if not e.num_blocks or self.index is None:
                return 0.0
            return min(self.index.num_blocks_of(e) / e.num_blocks, 1.0)

        def cost(e: Endpoint) -> float:
            stored = loaded(e)
            computed = max(request.num_prompt_tokens - cached(e) - len(stored) * e.block_size, 0)
            loading = sum(1 - STORE_CREDIT[tier] for tier in stored) * e.block_size
            decoding = self.decode_weight * e.in_flight_decode_tokens
            if role == "decode":
                return computed + loading + decoding
            evicting = EVICTION_WEIGHT * occupancy(e) * (request.num_prompt_tokens - cached(e))
            queued = self.prefill_weight * e.in_flight_prefill_tokens
            return computed + loading + evicting + queued + decoding

        least = min((e.num_in_flight for e in candidates), default=0)
        balanced = [
            e for e in candidates if e.num_in_flight <= BALANCE_FACTOR * least + BALANCE_SLACK
        ]
        best = min(balanced or candidates, key=lambda e: (cost(e), e.num_routed), default=None)
        if best is None:
            return None
        most_cached = max(cached(e) for e in candidates)
        reason = (
            ("store" if loaded(best) else "cold")
            if not most_cached
            else "cache"
            if cached(best) == most_cached
            else "load"
        )
        num_not_computed = min(
            cached(best) + len(loaded(best)) * best.block_size, request.num_prompt_tokens
        )
        return Route(best, reason, num_not_computed)
