"""The gateway's configuration: flags and environment, checked once."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GatewayConfig:
    model: str  # the model folder: tokenizer, chat template, context length
    workers: tuple[str, ...]  # host:port of each worker
    host: str = "127.0.0.1"
    port: int = 0  # gRPC; 0: any free port; printed at start
    http_port: int = 0  # OpenAI-compatible HTTP; 0: any free port; printed at start
    request_timeout_s: float = 600.0  # no call to a worker outlives this

    def __post_init__(self):
        if not os.path.isfile(os.path.join(self.model, "tokenizer.json")):
            raise ValueError(f"--model {self.model!r} has no tokenizer.json; the gateway needs the model's tokenizer")
        if not self.workers:
            raise ValueError("--workers needs at least one host:port")
        if self.request_timeout_s <= 0:
            raise ValueError("--request-timeout-s must be positive")

    @staticmethod
    def from_args(argv: Optional[list[str]] = None) -> "GatewayConfig":
        env = os.environ.get
        ap = argparse.ArgumentParser(prog="python -m services.gateway", description="tandem gateway")
        ap.add_argument("--model", default=env("TANDEM_MODEL"), required=env("TANDEM_MODEL") is None)
        ap.add_argument("--workers", default=env("TANDEM_WORKERS", ""), help="comma-separated host:port list")
        ap.add_argument("--host", default=env("TANDEM_GATEWAY_HOST", "127.0.0.1"))
        ap.add_argument("--port", type=int, default=int(env("TANDEM_GATEWAY_PORT", "0")))
        ap.add_argument("--http-port", type=int, default=int(env("TANDEM_GATEWAY_HTTP_PORT", "0")))
        ap.add_argument("--request-timeout-s", type=float, default=600.0)
        args = ap.parse_args(argv)
        workers = tuple(w.strip() for w in args.workers.split(",") if w.strip())
        return GatewayConfig(model=args.model, workers=workers, host=args.host, port=args.port, http_port=args.http_port,
                             request_timeout_s=args.request_timeout_s)
