"""The gateway's configuration: flags and environment, checked once (flags generated from the
fields by services/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.gguf.folder import resolve_fields
from engine.tokenizer import has_tokenizer, missing_tokenizer
from services import settings
from services.gateway.pricing import Prices
from services.gateway.routing.policies.kv import DECODE_WEIGHT, PREFILL_WEIGHT


@dataclass(frozen=True)
class GatewayConfig(settings.ServiceConfig):
    SERVICE = "gateway"
    DESCRIPTION = "tandem gateway"
    model: str = field(
        metadata={
            "help": "the model folder: tokenizer, chat template, context length",
            "env": "TANDEM_MODEL",
        }
    )
    workers: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "colocated workers, comma-separated host:port or dns:NAME:PORT",
            "env": "TANDEM_WORKERS",
        },
    )
    prefill: tuple[str, ...] = field(
        default=(),
        metadata={"help": "prefill workers (disaggregated)", "env": "TANDEM_PREFILL_WORKERS"},
    )
    decode: tuple[str, ...] = field(
        default=(),
        metadata={"help": "decode workers (disaggregated)", "env": "TANDEM_DECODE_WORKERS"},
    )
    workers_file: str | None = field(
        default=None,
        metadata={
            "help": 'JSON {"both"|"prefill"|"decode": [...]}, re-read when it changes',
            "env": "TANDEM_WORKERS_FILE",
        },
    )
    restarts_file: str = field(
        default="",
        metadata={
            "help": "JSON {role: restarts} that `make run`'s supervisor writes; /metrics shows "
            "it as tandem:process_restarts_total (deploy/supervisor.py)"
        },
    )
    http_port: int = field(
        default=0,
        metadata={
            "help": "OpenAI-compatible HTTP (and /metrics) port; 0: any free port",
            "env": "TANDEM_GATEWAY_HTTP_PORT",
        },
    )
    request_timeout_s: float = field(
        default=600.0, metadata={"help": "no call to a worker outlives this"}
    )
    prefill_timeout_s: float = field(
        default=120.0, metadata={"help": "a Prefill call past this is retried on another worker"}
    )
    max_queued_requests: int = field(
        default=10000, metadata={"help": "requests that may wait for a worker slot; beyond it: 429"}
    )
    queue_timeout_s: float = field(
        default=300.0, metadata={"help": "longest wait for a worker slot; past it: 429"}
    )
    router: str = field(
        default="kv",
        metadata={
            "help": "routing policy (services/gateway/routing/)",
            "env": "TANDEM_ROUTER",
            "choices": ("kv", "load", "round_robin"),
        },
    )
    kv_prefill_weight: float = field(
        default=PREFILL_WEIGHT, metadata={"help": "kv router: weight of queued prompt tokens"}
    )
    kv_decode_weight: float = field(
        default=DECODE_WEIGHT, metadata={"help": "kv router: weight of in-flight decode tokens"}
    )
    max_sessions: int = field(
        default=100_000, metadata={"help": "x-session-affinity table size (LRU beyond)"}
    )
    session_ttl_s: float = field(
        default=1800.0, metadata={"help": "an idle session's affinity expires after this"}
    )
    kv_store: str = field(
        default="",
        metadata={
            "help": "the KV cache store, HOST:PORT, or a Mooncake pool, mooncake://...: routing "
            "counts what workers can load from it",
            "env": "TANDEM_KV_STORE",
        },
    )
    prices: str = field(
        default="",
        metadata={
            "help": "USD per million tokens, e.g. input:0.60,cached_input:0.10,output:3.00: usage then carries cost",
            "env": "TANDEM_PRICES",
        },
    )
    api_keys_file: str = field(
        default="",
        metadata={
            "help": "JSON file of API keys (hashed) and per-key limits; none: no auth (services/gateway/api_keys.py)",
            "env": "TANDEM_API_KEYS_FILE",
        },
    )
    max_stored_responses: int = field(
        default=10_000,
        metadata={
            "help": "Responses API: past responses kept for previous_response_id (oldest dropped first; 0: none)"
        },
    )
    stored_response_ttl_s: float = field(
        default=3600.0,
        metadata={"help": "Responses API: how long a stored response can be continued"},
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "on SIGTERM: how long in-flight requests may run on before the gateway exits"
        },
    )
    tool_call_parser: str = field(
        default="",
        metadata={
            "help": "the markup tool calls come in (services/gateway/output/tool_formats.py, "
            "vLLM's names); default: detected from the chat template",
            "env": "TANDEM_TOOL_CALL_PARSER",
        },
    )
    reasoning_parser: str = field(
        default="",
        metadata={
            "help": "the markup reasoning comes in (services/gateway/output/reasoning.py: "
            "deepseek_r1, qwen3, kimi_k2, openai_gptoss; none: off); default: detected from the chat "
            "template and model_type",
            "env": "TANDEM_REASONING_PARSER",
        },
    )

    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "load a tokenizer only the checkpoint's own Python reads "
            "(tokenizer_config.json's auto_map) through transformers, running that code; "
            "tokenizer.json and tiktoken.model are still read natively first",
            "env": "TANDEM_TRUST_REMOTE_CODE",
        },
    )

    def __post_init__(self):
        super().__post_init__()
        resolve_fields(self, "model")
        if not has_tokenizer(self.model, self.trust_remote_code):
            raise ValueError(
                f"--model {self.model!r}: the gateway needs the model's tokenizer: "
                f"{missing_tokenizer(self.model)}"
            )
        if not (self.workers or self.prefill or self.decode or self.workers_file):
            raise ValueError(
                "no workers: give --workers, or --prefill and --decode, or --workers-file"
            )
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("a disaggregated setup needs both --prefill and --decode workers")
        if min(self.request_timeout_s, self.prefill_timeout_s, self.queue_timeout_s) <= 0:
            raise ValueError(
                "--request-timeout-s, --prefill-timeout-s and --queue-timeout-s must be positive"
            )
        Prices.parse(self.prices)  # raises ValueError with what is wrong
        if self.max_queued_requests < 0 or self.drain_timeout_s < 0:
            raise ValueError("--max-queued-requests and --drain-timeout-s must not be negative")
