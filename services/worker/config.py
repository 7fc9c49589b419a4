"""The worker's configuration: flags and environment, checked once."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional


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

    def __post_init__(self):
        if not os.path.isdir(self.model):
            raise ValueError(f"--model {self.model!r} is not a directory")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], not {self.port}")
        if self.role != "both":
            raise ValueError("only --role both is served so far (prefill/decode arrive with disaggregation)")

    @staticmethod
    def from_args(argv: Optional[list[str]] = None) -> "WorkerConfig":
        env = os.environ.get
        ap = argparse.ArgumentParser(prog="python -m services.worker", description="tandem worker")
        ap.add_argument("--model", default=env("TANDEM_MODEL"), required=env("TANDEM_MODEL") is None)
        ap.add_argument("--host", default=env("TANDEM_WORKER_HOST", "127.0.0.1"))
        ap.add_argument("--port", type=int, default=int(env("TANDEM_WORKER_PORT", "0")))
        ap.add_argument("--role", default=env("TANDEM_ROLE", "both"), choices=["both", "prefill", "decode"])
        ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
        ap.add_argument("--kv-cache-bytes", type=int, default=None)
        ap.add_argument("--max-num-seqs", type=int, default=64)
        ap.add_argument("--max-num-batched-tokens", type=int, default=512)
        args = ap.parse_args(argv)
        return WorkerConfig(
            model=args.model, host=args.host, port=args.port, role=args.role, dtype=args.dtype,
            kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
