"""`make run`'s settings with a fixed set of values: a value the launcher does not know is
refused with one line before anything starts (a typo such as `KV_STORE=yes` must not start a
stack without a store and say nothing).

The sets come from where the services define them (their config's `choices`, the transports'
and parsers' registries), so a value a service gains is one the launcher accepts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from engine.config import EngineConfig
from services.gateway.config import GatewayConfig
from services.gateway.output import reasoning, tool_formats
from services.kvtransfer import TRANSPORTS

KV_STORES = ("off", "on", "mooncake")


def _choices(config: type, name: str) -> tuple[str, ...]:
    field = next(f for f in dataclasses.fields(config) if f.name == name)
    return tuple(field.metadata["choices"])


def enumerated() -> dict[str, tuple[str, ...]]:
    """Each enumerated setting and the values it takes."""
    return {
        "TOPOLOGY": ("colocated", "disaggregated"),
        "KV_TRANSPORT": tuple(TRANSPORTS),
        "KV_STORE": KV_STORES,
        "ROUTER": _choices(GatewayConfig, "router"),
        "SPECULATIVE": _choices(EngineConfig, "speculative"),
        "DTYPE": _choices(EngineConfig, "dtype"),
        "TOOL_CALL_PARSER": tuple(tool_formats.FORMATS),
        "REASONING_PARSER": (*reasoning.FORMATS, "none"),
        "PUBLIC_METRICS": ("0", "1"),
        "TRUST_REMOTE_CODE": ("0", "1"),
        "DRAFT_SERVICE": ("0", "1"),
        "EP": ("0", "1"),
    }


# Counts and ports: a positive whole number.
COUNTS = (
    "PORT",
    "WORKERS",
    "PREFILL",
    "DECODE",
    "TP",
    "PP",
    "SPEC_TOKENS",
    "KV_STORE_NODES",
    "KV_STORE_REPLICAS",
    "ENVOY_MAX_CONNECTIONS",
)


def refusal(environ: Mapping[str, str]) -> str | None:
    """The one line refusing the first setting with a value `make run` does not know; None
    when every one is known. An unset or empty setting takes its default."""
    for name, values in enumerated().items():
        value = environ.get(name)
        if value and value not in values:
            return f"make run: {name}={value} is not one of {', '.join(values)}"
    for name in COUNTS:
        value = environ.get(name)
        if value and not (value.isdigit() and int(value) > 0):
            return f"make run: {name}={value} is not a positive whole number"
    return None
