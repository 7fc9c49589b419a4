"""Routing policies: which worker of a role gets a request. One file per policy, each with its
whole algorithm and every threshold in its docstring; `create(name)` picks one by name
(`--router`, `make run ROUTER=`)."""

from services.gateway.routing.policies.base import Policy, Route, RouteRequest  # noqa: F401
from services.gateway.routing.policies.kv import DECODE_WEIGHT, PREFILL_WEIGHT, KVPolicy
from services.gateway.routing.policies.load import LoadPolicy
from services.gateway.routing.policies.round_robin import RoundRobinPolicy

POLICIES = {"kv": KVPolicy, "load": LoadPolicy, "round_robin": RoundRobinPolicy}


def create(
    name: str,
    index,
    kv_prefill_weight: float = PREFILL_WEIGHT,
    kv_decode_weight: float = DECODE_WEIGHT,
) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"--router must be one of {', '.join(POLICIES)}, not {name!r}")
    if name == "kv":
        return KVPolicy(index, kv_prefill_weight, kv_decode_weight)
    return POLICIES[name](index)
