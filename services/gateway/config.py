"""The gateway's configuration: flags and environment, checked once."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Optional


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


@dataclass(frozen=True)
class GatewayConfig:
    model: str  # the model folder: tokenizer, chat template, context length
    workers: tuple[str, ...] = ()  # colocated workers: host:port or dns:NAME:PORT
    prefill: tuple[str, ...] = ()  # prefill workers (disaggregated)
    decode: tuple[str, ...] = ()  # decode workers (disaggregated)
    workers_file: Optional[str] = None  # JSON {"both"|"prefill"|"decode": [...]}, re-read on change
    host: str = "127.0.0.1"
    port: int = 0  # gRPC; 0: any free port; printed at start
    http_port: int = 0  # OpenAI-compatible HTTP; 0: any free port; printed at start
    request_timeout_s: float = 600.0  # no call to a worker outlives this
    prefill_timeout_s: float = 120.0  # a Prefill call past this is retried on another worker

    def __post_init__(self):
        if not os.path.isfile(os.path.join(self.model, "tokenizer.json")):
            raise ValueError(f"--model {self.model!r} has no tokenizer.json; the gateway needs the model's tokenizer")
        if not (self.workers or self.prefill or self.decode or self.workers_file):
            raise ValueError("no workers: give --workers, or --prefill and --decode, or --workers-file")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("a disaggregated setup needs both --prefill and --decode workers")
        if self.request_timeout_s <= 0 or self.prefill_timeout_s <= 0:
            raise ValueError("--request-timeout-s and --prefill-timeout-s must be positive")

    @staticmethod
    def from_args(argv: Optional[list[str]] = None) -> "GatewayConfig":
        env = os.environ.get
        ap = argparse.ArgumentParser(prog="python -m services.gateway", description="tandem gateway")
        ap.add_argument("--model", default=env("TANDEM_MODEL"), required=env("TANDEM_MODEL") is None)
        ap.add_argument("--workers", default=env("TANDEM_WORKERS", ""), help="colocated workers, comma-separated")
        ap.add_argument("--prefill", default=env("TANDEM_PREFILL_WORKERS", ""), help="prefill workers")
        ap.add_argument("--decode", default=env("TANDEM_DECODE_WORKERS", ""), help="decode workers")
        ap.add_argument("--workers-file", default=env("TANDEM_WORKERS_FILE"))
        ap.add_argument("--host", default=env("TANDEM_GATEWAY_HOST", "127.0.0.1"))
        ap.add_argument("--port", type=int, default=int(env("TANDEM_GATEWAY_PORT", "0")))
        ap.add_argument("--http-port", type=int, default=int(env("TANDEM_GATEWAY_HTTP_PORT", "0")))
        ap.add_argument("--request-timeout-s", type=float, default=600.0)
        ap.add_argument("--prefill-timeout-s", type=float, default=120.0)
        args = ap.parse_args(argv)
        return GatewayConfig(
            model=args.model, workers=_addresses(args.workers), prefill=_addresses(args.prefill),
            decode=_addresses(args.decode), workers_file=args.workers_file, host=args.host, port=args.port,
            http_port=args.http_port, request_timeout_s=args.request_timeout_s,
            prefill_timeout_s=args.prefill_timeout_s,
        )
