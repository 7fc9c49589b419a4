"""The worker's configuration: flags and environment, checked once.

One config for the three roles; each role's entry point fixes `role`
(`services.worker`: both, `services.prefill`, `services.decode`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional

from services.kvtransfer import TRANSPORTS

ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class WorkerConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the bound port is printed at start
    role: str = "both"
    dtype: str = "auto"
    kv_cache_bytes: Optional[int] = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    kv_transport: str = "ucx"  # decode role: how prefill workers push KV here
    kv_timeout_s: float = 30.0  # a KV transfer, and a decode worker's wait for landed KV

    def __post_init__(self):
        if not os.path.isdir(self.model):
            raise ValueError(f"--model {self.model!r} is not a directory")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], not {self.port}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
        if self.kv_transport not in TRANSPORTS:
            raise ValueError(f"--kv-transport must be one of {TRANSPORTS}, not {self.kv_transport!r}")
        if self.kv_timeout_s <= 0:
            raise ValueError("--kv-timeout-s must be positive")

    @staticmethod
    def from_args(role: str, argv: Optional[list[str]] = None) -> "WorkerConfig":
        env = os.environ.get
        prog = "python -m services." + {"both": "worker"}.get(role, role)
        ap = argparse.ArgumentParser(prog=prog, description=f"tandem worker (role: {role})")
        ap.add_argument("--model", default=env("TANDEM_MODEL"), required=env("TANDEM_MODEL") is None)
        ap.add_argument("--host", default=env("TANDEM_WORKER_HOST", "127.0.0.1"))
        ap.add_argument("--port", type=int, default=int(env("TANDEM_WORKER_PORT", "0")))
        ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        ap.add_argument("--kv-cache-bytes", type=int, default=None)
        ap.add_argument("--max-num-seqs", type=int, default=64)
        ap.add_argument("--max-num-batched-tokens", type=int, default=512)
        ap.add_argument("--kv-transport", default=env("TANDEM_KV_TRANSPORT", "ucx"), choices=TRANSPORTS)
        ap.add_argument("--kv-timeout-s", type=float, default=30.0)
        args = ap.parse_args(argv)
        return WorkerConfig(
            model=args.model, host=args.host, port=args.port, role=role, dtype=args.dtype,
            kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, kv_transport=args.kv_transport,
            kv_timeout_s=args.kv_timeout_s,
        )
