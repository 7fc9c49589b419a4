"""`load`: token-aware load balancing, blind to what any worker has cached.

The load of an endpoint is what this gateway has in flight on it (services/gateway/routing/endpoints.py):
- in-flight prefill tokens: prompt tokens sent and not yet answered with a first token;
- in-flight decode tokens: for each request past its first token and not finished, its
  prompt length + max_tokens (the KV it may grow to, which is what a decode step reads);
  counted from routing for a prompt with at most one block left to compute (it joins the
  running batch at once: endpoints.py, `InFlight`).

Policies, among healthy endpoints of the role:
- prefill: fewest in-flight prefill tokens. A worker handed a long prompt gets no new
  prompts until the others have as much queued, so prompts queue where they'll start soonest.
- decode: among endpoints whose reported free KV blocks hold the prompt, fewest in-flight
  decode tokens; if none reports room, the one with the most free blocks (it may still
  refuse: the caller sees RESOURCE_EXHAUSTED).
- colocated: fewest in-flight prefill + decode tokens.
Colocated and decode picks prefer endpoints whose batch still has room (fewer requests from
this gateway than the worker's `max_num_seqs`); the admission queue (admission.py) keeps the
total within the batches, so this only steers a request off a full worker onto one with room.
Ties go to the endpoint with fewer requests routed so far, so equal loads alternate.
"""

from __future__ import annotations

from services.gateway.routing.endpoints import Endpoint
from services.gateway.routing.policies.base import Policy, Route, RouteRequest


def _least(endpoints: list[Endpoint], load) -> Endpoint | None:
    return min(endpoints, key=lambda e: (load(e), e.num_routed), default=None)


def pick_prefill(endpoints: list[Endpoint], exclude: tuple[Endpoint, ...] = ()) -> Endpoint | None:
    return _least([e for e in endpoints if e not in exclude], lambda e: e.in_flight_prefill_tokens)


def with_room(endpoints: list[Endpoint]) -> list[Endpoint]:
    return [e for e in endpoints if e.has_room or not e.max_num_seqs] or endpoints


def pick_decode(endpoints: list[Endpoint], num_prompt_tokens: int) -> Endpoint | None:
    endpoints = with_room(endpoints)
    roomy = [e for e in endpoints if e.num_free_blocks * e.block_size >= num_prompt_tokens]
    if not roomy:
        return _least(endpoints, lambda e: -e.num_free_blocks)
    return _least(roomy, lambda e: e.in_flight_decode_tokens)


def pick_colocated(
    endpoints: list[Endpoint], exclude: tuple[Endpoint, ...] = ()
) -> Endpoint | None:
    endpoints = with_room([e for e in endpoints if e not in exclude])
    return _least(endpoints, lambda e: e.in_flight_prefill_tokens + e.in_flight_decode_tokens)


class LoadPolicy(Policy):
    name = "load"

    def pick(self, role: str, request: RouteRequest, candidates: list[Endpoint]) -> Route | None:
        if role == "prefill":
            endpoint = pick_prefill(candidates)
        elif role == "decode":
            endpoint = pick_decode(candidates, request.num_prompt_tokens)
        else:
            endpoint = pick_colocated(candidates)
        return Route(endpoint, "least_tokens") if endpoint is not None else None
