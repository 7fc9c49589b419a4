"""`round_robin`: each role's endpoints in turn, blind to load and cache (a baseline)."""

from __future__ import annotations

from services.gateway.routing.endpoints import Endpoint
from services.gateway.routing.policies.base import Policy, Route, RouteRequest


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, index=None):
        super().__init__(index)
        self._turn: dict[str, int] = {}

    def pick(self, role: str, request: RouteRequest, candidates: list[Endpoint]) -> Route | None:
        ordered = sorted(candidates, key=lambda e: e.address)
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        return Route(ordered[turn % len(ordered)], "turn")
