"""The interface every routing policy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from services.gateway.routing.endpoints import Endpoint


@dataclass
class RouteRequest:
    """What a policy may know of a request."""

    num_prompt_tokens: int
    max_tokens: int
    block_hashes: list[int] = field(default_factory=list)  # the prompt's full blocks, chained
    session: str = ""  # x-session-affinity, if the client sent one
    # KV store: dram | disk per block of its stored prefix
    stored_tiers: list[str] = field(default_factory=list)


@dataclass
class Route:
    endpoint: Endpoint
    reason: str  # a metrics label: why this worker
    num_cached_tokens: int = 0  # the prompt tokens it is expected to hold cached


class Policy(ABC):
    """Picks one endpoint among `candidates`: the healthy, non-draining endpoints of `role`
    (`both`, `prefill` or `decode`), never empty. Reads the endpoints' in-flight loads and
    free blocks, and the prefix index; changes nothing (the caller counts the load)."""

    name = ""

    def __init__(self, index=None):
        self.index = index  # services.gateway.routing.prefix_index.PrefixIndex

    @abstractmethod
    def pick(
        self, role: str, request: RouteRequest, candidates: list[Endpoint]
    ) -> Route | None: ...
