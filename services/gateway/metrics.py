"""The gateway's Prometheus metrics (on its HTTP port at /metrics, and through Envoy). Names
follow vLLM's where one exists, with the `tandem:` prefix. Latencies are as the gateway sees
them: from the request's arrival (queueing included) to each token leaving for the client."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

# Its own registry (the process, platform and GC collectors included), so the gateway's and a
# worker's metrics never meet in one registry when both run in one process (tests).
REGISTRY = CollectorRegistry()
for collector in (ProcessCollector, PlatformCollector, GCCollector):
    collector(registry=REGISTRY)

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
TOKEN_COUNT_BUCKETS = (
    1,
    2,
    5,
    10,
    20,
    50,
    100,
    200,
    500,
    1000,
    2000,
    5000,
    10000,
    20000,
    50000,
    100000,
)

REQUEST_SUCCESS = Counter(
    "tandem:request_success",
    "Requests finished, by finish reason.",
    ["finished_reason"],
    registry=REGISTRY,
)
REQUEST_ERRORS = Counter(
    "tandem:request_errors",
    "Requests that ended in an error, by status code.",
    ["code"],
    registry=REGISTRY,
)
# Every admitted request once, as it ends: "ok", an error's status code, or "cancelled". With
# tandem:requests_refused (refused before admission) it is the request rate by surface.
REQUESTS = Counter(
    "tandem:requests",
    "Admitted requests ended, by API surface and status (ok, an error's code, cancelled).",
    ["surface", "status"],
    registry=REGISTRY,
)
NUM_RUNNING = Gauge(
    "tandem:num_requests_running", "Requests admitted and not yet finished.", registry=REGISTRY
)
NUM_WAITING = Gauge(
    "tandem:num_requests_waiting",
    'Requests waiting in the admission queue, by API key name ("" without keys).',
    ["key"],
    registry=REGISTRY,
)

TTFT = Histogram(
    "tandem:time_to_first_token_seconds",
    "Arrival to first token.",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
TPOT = Histogram(
    "tandem:request_time_per_output_token_seconds",
    "A request's mean time per output token after the first.",
    buckets=TOKEN_LATENCY_BUCKETS,
    registry=REGISTRY,
)
ITL = Histogram(
    "tandem:inter_token_latency_seconds",
    "Time between two chunks of tokens, per token.",
    buckets=TOKEN_LATENCY_BUCKETS,
    registry=REGISTRY,
)
E2E = Histogram(
    "tandem:e2e_request_latency_seconds",
    "Arrival to the last token.",
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
QUEUE_TIME = Histogram(
    "tandem:request_queue_time_seconds",
    "Time spent in the admission queue, by API key name.",
    ["key"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
NUM_WAITING.labels("")  # without keys, one series from the start, as before keys existed
PROMPT_TOKENS = Histogram(
    "tandem:request_prompt_tokens", "Prompt length.", buckets=TOKEN_COUNT_BUCKETS, registry=REGISTRY
)
GENERATION_TOKENS = Histogram(
    "tandem:request_generation_tokens",
    "Generated tokens.",
    buckets=TOKEN_COUNT_BUCKETS,
    registry=REGISTRY,
)
CACHED_TOKENS = Counter(
    "tandem:prompt_tokens_cached",
    "Prompt tokens served from a worker's prefix cache.",
    registry=REGISTRY,
)
CACHED_TOKENS_BY_TIER = Counter(
    "tandem:prompt_tokens_cached_by_tier",
    "Prompt tokens not computed, by where their KV came from: local (the worker's prefix "
    "cache), store_dram, store_disk, mooncake_dram, mooncake_disk.",
    ["tier"],
    registry=REGISTRY,
)
PROMPT_TOKENS_TOTAL = Counter(
    "tandem:prompt_tokens", "Prompt tokens of finished requests.", registry=REGISTRY
)
GENERATION_TOKENS_TOTAL = Counter(
    "tandem:generation_tokens", "Tokens generated.", registry=REGISTRY
)

REFUSED = Counter(
    "tandem:requests_refused",
    "Requests answered with an error, by API surface, the field it names "
    "(empty: none) and HTTP status.",
    ["surface", "field", "status"],
    registry=REGISTRY,
)

ROUTING = Counter(
    "tandem:routing_decisions",
    "Workers picked, by policy and reason.",
    ["policy", "reason"],
    registry=REGISTRY,
)

# Per API key (services/gateway/api_keys.py), by the key's name; `key` is empty for a call
# with no key or an unknown one.
KEY_REQUESTS = Counter(
    "tandem:api_key_requests", "Requests admitted, by API key name.", ["key"], registry=REGISTRY
)
KEY_REJECTED = Counter(
    "tandem:api_key_rejected",
    "Calls refused, by API key name and reason (no_key, wrong_key, requests, tokens).",
    ["key", "reason"],
    registry=REGISTRY,
)
KEY_TOKENS = Counter(
    "tandem:api_key_tokens",
    "Tokens of finished requests, by API key name and kind (prompt, "
    "cached: of the prompt, completion).",
    ["key", "kind"],
    registry=REGISTRY,
)
KEY_COST = Counter(
    "tandem:api_key_cost_usd",
    "Cost of finished requests at the gateway's --prices, by API key name.",
    ["key"],
    registry=REGISTRY,
)
