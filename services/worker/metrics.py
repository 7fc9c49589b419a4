"""A worker's Prometheus metrics (served on `--metrics-port`). Names follow vLLM's where one
exists, with the `tandem:` prefix."""

from __future__ import annotations

import grpc
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

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
TRANSFER_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

NUM_RUNNING = Gauge(
    "tandem:num_requests_running", "Requests in the engine's running batch.", registry=REGISTRY
)
NUM_WAITING = Gauge(
    "tandem:num_requests_waiting", "Requests waiting in the engine's queue.", registry=REGISTRY
)
# Each role's load, for autoscaling (deploy/k8s: the HPAs of prefill and decode workers).
PROMPT_TOKENS_PENDING = Gauge(
    "tandem:num_prompt_tokens_pending",
    "Prompt tokens admitted and not yet computed.",
    registry=REGISTRY,
)
DECODE_TOKENS_RUNNING = Gauge(
    "tandem:num_decode_tokens_running",
    "Context tokens of the requests decoding.",
    registry=REGISTRY,
)
KV_BLOCKS_USED = Gauge(
    "tandem:kv_blocks_used",
    "KV blocks held by sequences or reserved for incoming KV.",
    registry=REGISTRY,
)
KV_BLOCKS_FREE = Gauge(
    "tandem:kv_blocks_free",
    "KV blocks free (cached prefix blocks count as free).",
    registry=REGISTRY,
)
KV_USAGE = Gauge(
    "tandem:kv_cache_usage_perc", "Share of KV blocks in use, 0 to 1.", registry=REGISTRY
)
PREEMPTIONS = Gauge(
    "tandem:num_preemptions",
    "Sequences preempted since start (recomputed later).",
    registry=REGISTRY,
)
SPEC_DRAFT_TOKENS = Gauge(
    "tandem:spec_decode_num_draft_tokens",
    "Speculative draft tokens verified since start.",
    registry=REGISTRY,
)
SPEC_ACCEPTED_TOKENS = Gauge(
    "tandem:spec_decode_num_accepted_tokens",
    "Speculative draft tokens kept since start.",
    registry=REGISTRY,
)
ENGINE_STEP = Histogram(
    "tandem:engine_step_seconds",
    "One engine step: schedule, forward, sample.",
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)

REQUESTS = Counter(
    "tandem:worker_requests",
    "Requests this worker ended, by outcome.",
    ["outcome"],
    registry=REGISTRY,
)
PREFIX_CACHE_QUERIES = Counter(
    "tandem:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=REGISTRY
)
PREFIX_CACHE_HITS = Counter(
    "tandem:prefix_cache_hits", "Prompt tokens served from the prefix cache.", registry=REGISTRY
)
PREFIX_CACHE_HIT_RATIO = Gauge(
    "tandem:prefix_cache_hit_ratio",
    "Prompt tokens served from the prefix cache over prompt tokens looked up, since start.",
    registry=REGISTRY,
)

KV_STORE_FAILURES = Counter(
    "tandem:kv_store_failures",
    "KV store calls that failed (a miss, never a request's error), by call and reason.",
    # call: load, store; reason: timeout (the deadline passed), error, full (a Mooncake pool
    # refused a put's blocks for want of room: not stored, no backoff)
    ["call", "reason"],
    registry=REGISTRY,
)


def count_store_failure(what: str, exc: BaseException) -> None:
    """One failed store call (`what`: "loading a prefix" or "storing blocks")."""
    deadline = isinstance(exc, TimeoutError) or (
        isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    )
    call = "load" if what.startswith("loading") else "store"
    KV_STORE_FAILURES.labels(call, "timeout" if deadline else "error").inc()


KV_STORE_BACKOFFS = Counter(
    "tandem:kv_store_backoffs",
    "Times a path to the KV store (load or store) was skipped for a while after a failure.",
    ["call"],
    registry=REGISTRY,
)
KV_STORE_WRITES_DROPPED = Counter(
    "tandem:kv_store_writes_dropped",
    "Write-throughs to the KV store never sent, by reason.",
    # queue_full: the oldest pending write, shed for a newer one; backoff: offered while the
    # store path was skipped
    ["reason"],
    registry=REGISTRY,
)


def count_store_full() -> None:
    """A put whose blocks (some or all) the store refused for want of room."""
    KV_STORE_FAILURES.labels("store", "full").inc()


KV_TRANSFER_BYTES = Counter(
    "tandem:kv_transfer_bytes", "KV bytes moved between workers.", ["direction"], registry=REGISTRY
)
KV_TRANSFER_SECONDS = Histogram(
    "tandem:kv_transfer_seconds",
    "One KV transfer, header to acknowledgement.",
    ["direction"],
    buckets=TRANSFER_BUCKETS,
    registry=REGISTRY,
)


def publish_engine_stats(stats) -> None:
    NUM_RUNNING.set(stats.num_running)
    NUM_WAITING.set(stats.num_waiting)
    PROMPT_TOKENS_PENDING.set(stats.num_prompt_tokens_pending)
    DECODE_TOKENS_RUNNING.set(stats.num_decode_tokens_running)
    used = stats.num_blocks - stats.num_free_blocks
    KV_BLOCKS_USED.set(used)
    KV_BLOCKS_FREE.set(stats.num_free_blocks)
    KV_USAGE.set(used / stats.num_blocks if stats.num_blocks else 0.0)
    PREEMPTIONS.set(stats.num_preemptions)
    SPEC_DRAFT_TOKENS.set(stats.num_draft_tokens)
    SPEC_ACCEPTED_TOKENS.set(stats.num_accepted_draft_tokens)


_prompt_totals = {"queries": 0, "hits": 0}


def count_prompt(num_prompt_tokens: int, num_cached_tokens: int) -> None:
    """Once per request, when its prompt is done."""
    PREFIX_CACHE_QUERIES.inc(num_prompt_tokens)
    PREFIX_CACHE_HITS.inc(num_cached_tokens)
    _prompt_totals["queries"] += num_prompt_tokens
    _prompt_totals["hits"] += num_cached_tokens
    if _prompt_totals["queries"]:
        PREFIX_CACHE_HIT_RATIO.set(_prompt_totals["hits"] / _prompt_totals["queries"])
