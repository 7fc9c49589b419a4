"""The worker's configuration: its own settings plus every engine setting, checked once.

One config for the three roles; each role's entry point fixes `role` (`services.worker`:
both, `services.prefill`, `services.decode`). The flags are generated from the fields here
and from `engine.config.EngineConfig` (services/settings.py), so a default lives in one place
and every engine setting reaches the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.cpu import available_cpus, format_cpu_list, parse_cpu_list
from services import settings
from services.kvtransfer import TRANSPORTS

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class WorkerConfig(settings.ServiceConfig):
    SERVICE = "worker"
    engine: EngineConfig
    metrics_port: int = field(
        default=0,
        metadata={
            "help": "Prometheus /metrics port; 0: any free port (printed at start)",
            "env": "TANDEM_METRICS_PORT",
        },
    )
    kv_transport: str = field(
        default="ucx",
        metadata={
            "help": "decode role: how prefill workers push KV here",
            "env": "TANDEM_KV_TRANSPORT",
            "choices": TRANSPORTS,
        },
    )
    kv_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "a KV transfer's deadline, and how long a decode worker keeps landed KV nobody claimed"
        },
    )
    kv_store: str = field(
        default="",
        metadata={
            "help": "the KV cache store (services/kvcache), HOST:PORT, or a Mooncake Store pool, "
            "mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT: load stored prefixes, "
            "write computed blocks through",
            "env": "TANDEM_KV_STORE",
        },
    )
    kv_store_replicas: int = field(
        default=1,
        metadata={"help": "a Mooncake pool: copies of each block put, on distinct store nodes"},
    )
    draft: str = field(
        default="",
        metadata={
            "help": "the draft service (services/draft), HOST:PORT: speculative drafts from it instead of in-process",
            "env": "TANDEM_DRAFT",
        },
    )
    reserved_cpus: int = field(
        default=1,
        metadata={
            "help": "CPUs the engine leaves to this worker's gRPC loop and, on one machine, the "
            "gateway, Envoy and clients, unless --cpu-threads or --cpus is set (at least one thread "
            "computes)",
            "env": "TANDEM_RESERVED_CPUS",
        },
    )
    cpus: str = field(
        default="",
        metadata={
            "help": "CPUs this worker runs on, pinned, e.g. '1' or '2-5': its engine computes on one "
            "thread each (unless --cpu-threads), its gRPC loop beside it. Empty: not pinned (the "
            "stack's launcher places each worker of one machine on CPUs of its own)",
            "env": "TANDEM_WORKER_CPUS",
        },
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "on SIGTERM: how long in-flight requests may run on before the worker exits"
        },
    )

    @property
    def role(self) -> str:
        return self.engine.role

    @property
    def cpu_list(self) -> list[int]:
        """--cpus as CPU numbers ([]: not pinned)."""
        return parse_cpu_list(self.cpus) if self.cpus else []

    def __post_init__(self):
        super().__post_init__()
        if not os.path.isdir(self.engine.model):
            raise ValueError(f"--model {self.engine.model!r} is not a directory")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(
                f"--kv-transport must be one of {TRANSPORTS}, not {self.kv_transport!r}"
            )
        if self.kv_store_replicas < 1:
            raise ValueError(
                f"--kv-store-replicas must be at least 1, not {self.kv_store_replicas}"
            )
        if self.reserved_cpus < 0:
            raise ValueError(f"--reserved-cpus must not be negative, not {self.reserved_cpus}")
        allowed = os.sched_getaffinity(0)
        for flag, text in (("--cpus", self.cpus), ("--borrowed-cpus", self.engine.borrowed_cpus)):
            if outside := set(parse_cpu_list(text) if text else ()) - allowed:
                raise ValueError(
                    f"{flag} {text!r}: CPUs {sorted(outside)} are not among this process's "
                    f"({format_cpu_list(sorted(allowed))})"
                )
        if self.kv_timeout_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError("--kv-timeout-s must be positive and --drain-timeout-s not negative")

    @staticmethod
    def from_args(role: str, argv: list[str] | None = None) -> WorkerConfig:
        prog = "python -m services." + {"both": "worker"}.get(role, role)
        parser = argparse.ArgumentParser(prog=prog, description=f"tandem worker (role: {role})")
        settings.add_flags(parser, WorkerConfig, skip=("engine",))
        settings.add_flags(parser, EngineConfig, skip=("role",))
        args = parser.parse_args(argv)
        engine_config = EngineConfig(
            role=role, **settings.values(args, EngineConfig, skip=("role",))
        )
        worker = settings.values(args, WorkerConfig, skip=("engine",))
        if not engine_config.cpu_threads:
            threads = (
                len(parse_cpu_list(worker["cpus"]))
                if worker["cpus"]
                else available_cpus() - worker["reserved_cpus"]
            )
            engine_config = dataclasses.replace(engine_config, cpu_threads=max(1, threads))
        return WorkerConfig(engine=engine_config, **worker)
