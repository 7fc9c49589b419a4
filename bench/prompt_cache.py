"""Prompt-cache hit ratio by routing policy, on a real production trace, through the public API.

    .venv/bin/python bench/prompt_cache.py [--requests 600] [--workers 4] [--blocks-per-worker 2048[,...]]
                                           [--time-scale 0.25] [--policies round_robin,load,kv,kv+session]
                                           [--store-dram-bytes N] [--store-disk-bytes N] [--store-nodes 2]
                                           [--pace clients|trace] [--first-request N] [--log FILE]
                                           [--chart docs/img/benchmarks/prompt_cache.png]

Workload: `--requests` rows from row `--first-request` (0) of bench/traces/mooncake_conversation_trace.jsonl
(Mooncake's production conversation trace: arrival times and prompts as chains of block ids,
equal ids = a shared prefix), or of `--trace` (the same format, e.g. bench/synth_trace.py's).
Each trace block becomes `--block-tokens` (16) synthetic token ids drawn from its id
(so equal trace blocks are equal tokens, and with 16 a tandem block is a trace block), prompts cut
at `--max-blocks` x 16 tokens (the demo model's context; 512 tokens a block, the trace's own
size, makes nearly every prompt that long and shares mostly the system prompt), 2 output tokens, sent as streamed
`/v1/completions` with token-id prompts at the trace's arrival times x `--time-scale`, at one of
two paces (bench/trace_pace.py): `--pace clients` (the default, and every figure in
bench/README.md before its "real client's pace" section) sends each request at its time or once
one of `--clients` client threads is free, so a slow server slows the trace down; `--pace trace`
sends every request at its time on its own thread, however many are in flight, as a real client
population does (use `--time-scale 1` for the trace's own pace).

For each policy a fresh stack (`--workers` colocated workers, each with a KV pool of
`--blocks-per-worker` blocks, gateway, Envoy: deploy/stack.py) replays the same requests, at each
of the sizes when `--blocks-per-worker` lists several (`512,1024,2048`: the hit ratio against
cache size; `--chart PATH.png` draws it, a line per policy, and writes the figures beside it as
PATH.json, from which bench/charts.py draws it again);
`kv+session` is `kv` with `x-session-affinity` set to the conversation (the prompt's first two block
ids; the first is a system prompt every request shares). `kv+store` adds the built-in KV store
(`KV_STORE=on`: `--store-dram-bytes`, default 4x the workers' total KV, and a disk tier of
`--store-disk-bytes`); `kv+mooncake` adds a Mooncake Store pool instead (`KV_STORE=mooncake`, the
same deploy/mooncake.py launch: a mooncake_master and `--store-nodes` nodes sharing
`--store-dram-bytes` and `--store-disk-bytes` between them, the disk Mooncake's SSD offload, each
node's in its own folder). For both, the store's CPU seconds (Mooncake's:
master and nodes) and the workers' failed store calls (`tandem:kv_store_failures_total`, by
reason; their store back-offs and shed writes, by reason) are printed; `--log` keeps every
process's stderr (the workers' store warnings among it). It prints the hit ratio (cached prompt
tokens / prompt tokens, from each response's usage), TTFT p50/p90, and per-worker balance (requests
per worker, max over mean, from the workers' own counts), against two references computed offline on
the same prompts: one pooled LRU cache of all workers' blocks together, and an unlimited cache (a
prompt's last token is never cached, as in the engine). Then bench/cluster_sim.py's figures for the
same policies on the whole trace at 4 and 32 simulated workers (of the last size's blocks).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import tempfile
import time

import grpc
import psutil

from bench import charts, cluster_sim, store_load, trace_pace
from deploy.stack import start_stack
from engine.block_hash import hash_blocks
from engine.config import ModelConfig
from engine.kv_cache import bytes_per_block
from engine.progress import Stage
from tandem.v1 import worker_pb2, worker_pb2_grpc

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRACE = os.path.join(REPO_ROOT, "bench", "traces", "mooncake_conversation_trace.jsonl")
BLOCK = 16


def load_requests(
    n: int,
    max_blocks: int,
    vocab: int,
    trace: str = TRACE,
    first: int = 0,
    block_tokens: int = BLOCK,
) -> list[dict]:
    """Rows `first` to `first + n` of the trace, arrival times from the first of them."""
    with open(trace) as f:
        rows = [json.loads(line) for _, line in zip(range(first + n), f)][first:]
    start = rows[0]["timestamp"]
    requests = []
    for row in rows:
        ids = row["hash_ids"][: -(-max_blocks * BLOCK // block_tokens)]
        tokens = [
            t
            for block in ids
            for t in random.Random(block).choices(range(3, vocab), k=block_tokens)
        ][: max_blocks * BLOCK]
        # The conversation: its first two blocks (every prompt of the trace shares block 0).
        requests.append(
            {
                "at_s": (row["timestamp"] - start) / 1000,
                "prompt": tokens,
                "num_tokens": len(tokens),
                "hashes": hash_blocks(tokens, BLOCK),
                "session": "c" + "-".join(map(str, ids[:2])),
            }
        )
    return requests


def send(address: str, request: dict, with_session: bool) -> dict:
    """One streamed completion of `request["prompt"]`: TTFT, prompt and cached tokens."""
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {
        "prompt": request["prompt"],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Content-Type": "application/json"}
    if with_session and "session" in request:
        headers["x-session-affinity"] = request["session"]
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    response, ttft, usage = conn.getresponse(), None, None
    for line in response:
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - started
            usage = event.get("usage") or usage
    conn.close()
    return {
        "ttft_s": ttft,
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "by_tier": usage["prompt_tokens_details"].get("cached_tokens_by_tier", {}),
    }


def served(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return (
            worker_pb2_grpc.WorkerStub(channel)
            .Health(worker_pb2.HealthRequest(), timeout=10)
            .num_requests
        )


STORE_COUNTERS = {
    "tandem:kv_store_failures_total": "reason",
    "tandem:kv_store_backoffs_total": "call",
    "tandem:kv_store_writes_dropped_total": "reason",
}


def store_counters(stack) -> dict[str, dict[str, int]]:
    """The workers' store counters so far (STORE_COUNTERS), summed over workers, by one label."""
    from prometheus_client.parser import text_string_to_metric_families

    from deploy.processes import named_address

    total: dict[str, dict[str, int]] = {name: {} for name in STORE_COUNTERS}
    for proc in stack.worker_processes.values():
        page = http.client.HTTPConnection(*named_address(proc, "metrics").split(":"), timeout=10)
        page.request("GET", "/metrics")
        for family in text_string_to_metric_families(page.getresponse().read().decode()):
            for s in family.samples:
                if s.name in STORE_COUNTERS:
                    by = total[s.name]
                    label = s.labels[STORE_COUNTERS[s.name]]
                    by[label] = by.get(label, 0) + int(s.value)
        page.close()
    return total


def cpu_seconds(stack) -> dict[str, float]:
    """CPU seconds (user + system) used so far, by kind of process."""
    kinds = {
        "services.worker": "workers",
        "services.gateway": "gateway",
        "services.kvcache": "store",  # the built-in store, and Mooncake's nodes
        "mooncake_master": "store",
    }
    used: dict[str, float] = {}
    for proc in stack.processes:
        p = psutil.Process(proc.pid)
        argv = " ".join(p.cmdline())
        kind = next((k for m, k in kinds.items() if m in argv), "envoy")
        used[kind] = used.get(kind, 0.0) + sum(p.cpu_times()[:2])
    return used


def replay(args, model: str, requests: list[dict], policy: str, kv_bytes: int) -> dict:
    router, with_session = policy.split("+")[0], "+session" in policy
    builtin, mooncake = "+store" in policy, "+mooncake" in policy
    store_dir = tempfile.TemporaryDirectory()
    dram_bytes = args.store_dram_bytes or 4 * args.workers * kv_bytes
    store_args = (
        ("--dram-bytes", str(dram_bytes), "--disk-bytes", str(args.store_disk_bytes))
        + ("--disk-dir", store_dir.name)
        if builtin
        else None
    )
    log = open(args.log, "a") if args.log else None
    if log is not None:
        print(f"=== {policy}", file=log, flush=True)
    stack = start_stack(
        model,
        num_workers=args.workers,
        stderr=log or subprocess.DEVNULL,
        worker_args=("--kv-cache-bytes", str(kv_bytes)),
        gateway_args=("--router", router, "--request-timeout-s", "600"),
        kv_store_args=store_args,
        mooncake=(args.store_nodes, dram_bytes // args.store_nodes, 1) if mooncake else None,
        mooncake_disk_bytes=args.store_disk_bytes // args.store_nodes,
        mooncake_disk_dir=store_dir.name,
    )
    try:
        before = {a: served(a) for a in stack.worker_addresses}
        cpu_before = cpu_seconds(stack)
        with Stage(f"replaying {policy}", len(requests), "requests") as progress:
            results = trace_pace.replay(
                [r["at_s"] for r in requests],
                progress.counted(lambda i: send(stack.envoy_address, requests[i], with_session)),
                args.pace,
                args.time_scale,
                args.clients,
            )
        counts = [served(a) - before[a] for a in stack.worker_addresses]
        cpu = {
            kind: round(s - cpu_before.get(kind, 0), 1) for kind, s in cpu_seconds(stack).items()
        }
        store = store_stats(stack.kv_store_address) if builtin else None
        counters = store_counters(stack) if builtin or mooncake else None
    finally:
        stack.stop()
        store_dir.cleanup()
        if log is not None:
            log.close()
    ttfts = sorted(r["ttft_s"] * 1e3 for r in results)
    return {
        "hit_ratio": sum(r["cached"] for r in results) / sum(r["prompt"] for r in results),
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))],
        "requests_per_worker": counts,
        "balance": max(counts) / (sum(counts) / len(counts)),
        "cpu_s": cpu,
        **({"store_hits": {"dram": store.dram.hits, "disk": store.disk.hits}} if store else {}),
        **(
            {
                "store_failures": counters["tandem:kv_store_failures_total"],
                "store_backoffs": counters["tandem:kv_store_backoffs_total"],
                "store_writes_dropped": counters["tandem:kv_store_writes_dropped_total"],
            }
            if counters is not None
            else {}
        ),
        "cached_by_tier": {
            tier: sum(r["by_tier"].get(tier, 0) for r in results) for tier in results[0]["by_tier"]
        },
    }


def store_stats(address: str):
    from tandem.v1 import kvcache_pb2, kvcache_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return kvcache_pb2_grpc.KVCacheStub(channel).Stats(kvcache_pb2.StatsRequest(), timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=os.path.join(REPO_ROOT, "demo", "tandem-demo"))
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument(
        "--first-request", type=int, default=0, help="the trace row the replay starts at"
    )
    ap.add_argument(
        "--pace",
        choices=trace_pace.PACES,
        default="clients",
        help="clients: at most --clients in flight; trace: every request at its time (open loop)",
    )
    ap.add_argument("--log", default="", help="append every process's stderr to this file")
    ap.add_argument(
        "--replay-only",
        action="store_true",
        help="skip the store-load figure and bench/cluster_sim.py's simulated fleets",
    )
    ap.add_argument(
        "--trace", default=TRACE, help="JSONL in the Mooncake format (bench/synth_trace.py)"
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument(
        "--blocks-per-worker",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default="2048",
        help="one size, or several (512,1024,2048): every policy at each",
    )
    ap.add_argument(
        "--max-blocks",
        type=int,
        default=60,
        help="prompts cut at this many 16-token blocks (the demo's context is 1,024)",
    )
    ap.add_argument(
        "--block-tokens", type=int, default=BLOCK, help="token ids per trace block (the trace: 512)"
    )
    ap.add_argument("--time-scale", type=float, default=0.25, help="x the trace's arrival times")
    ap.add_argument(
        "--clients",
        type=int,
        default=128,
        help="--pace clients: client threads (concurrent requests at most)",
    )
    ap.add_argument(
        "--policies", default="round_robin,load,kv,kv+session,kv+store", help="also kv+mooncake"
    )
    ap.add_argument(
        "--store-dram-bytes",
        type=int,
        default=0,
        help="the store's DRAM (Mooncake: all its nodes together); 0: 4x the workers' total KV",
    )
    ap.add_argument(
        "--store-disk-bytes",
        type=int,
        default=4 << 30,
        help="the store's disk tier (Mooncake: all its nodes together; 0: none)",
    )
    ap.add_argument("--store-nodes", type=int, default=2, help="Mooncake store nodes")
    ap.add_argument(
        "--chart", help="a PNG of the hit ratio against --blocks-per-worker, figures beside it"
    )
    args = ap.parse_args()
    if args.chart and not args.chart.endswith(".png"):
        ap.error(f"--chart {args.chart}: a .png path")
    sizes = args.blocks_per_worker
    config = ModelConfig.from_folder(args.model)
    import torch

    block_bytes = bytes_per_block(
        config, BLOCK, torch.float32 if config.torch_dtype == "float32" else torch.bfloat16
    )
    requests = load_requests(
        args.requests,
        args.max_blocks,
        config.vocab_size,
        args.trace,
        args.first_request,
        args.block_tokens,
    )
    with open("/proc/cpuinfo") as f:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            "unknown",
        )
    print(
        f"CPU: {cpu}, {os.cpu_count()} cores; {len(requests)} trace requests over "
        f"{requests[-1]['at_s'] * args.time_scale:.0f} s, {sum(len(r['prompt']) for r in requests)} prompt tokens; "
        f"{args.workers} workers x {'/'.join(map(str, sizes))} blocks; pace {args.pace}"
    )
    unlimited = cluster_sim.reference_hit_ratio(requests, None)
    report = {
        "unlimited": unlimited,
        "args": vars(args),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "by_blocks_per_worker": {},
    }
    for blocks in sizes:
        report["by_blocks_per_worker"][str(blocks)] = replay_policies(
            args, requests, blocks, blocks * block_bytes, unlimited
        )
    write_report(report)
    if args.chart:  # before the simulated fleets: the chart draws the replays only
        charts.write(charts.prompt_cache_figures(report), args.chart)
        print(f"\nchart: {args.chart} (figures: {charts.figures_path(args.chart)})", flush=True)
    if "kv+store" in args.policies.split(",") and not args.replay_only:
        r = store_load.measure(args.model, num_tokens=900, repeats=5)
        print(
            f"\na 900-token prompt on a worker with an empty cache (bench/store_load.py), first token, median of 5: "
            f"loaded from the store {r['loaded_ms']:.1f} ms, computed {r['computed_ms']:.1f} ms: "
            f"{r['computed_ms'] / r['loaded_ms']:.2f}x faster loaded"
        )
    # The same policies on a simulated fleet (bench/cluster_sim.py), the whole trace, 4 and 32
    # workers; it has no model of a Mooncake pool.
    simulated = [
        p for p in args.policies.split(",") if "+mooncake" not in p and not args.replay_only
    ]
    trace = cluster_sim.load_trace(0, 0, args.trace) if simulated else []
    blocks = sizes[-1]
    for n in (4, 32) if simulated else ():
        results = {
            p: cluster_sim.simulate(trace, n, p, blocks, cluster_sim.PROFILES["cpu-demo"])
            for p in simulated
        }
        cluster_sim.print_table(
            results,
            f"cluster_sim: {n} workers x {blocks} blocks, the whole trace "
            f"({len(trace)} requests), profile cpu-demo",
        )
        print(
            f"references: pooled LRU {cluster_sim.reference_hit_ratio(trace, n * blocks):.3f}, "
            f"unlimited {cluster_sim.reference_hit_ratio(trace, None):.3f}"
        )
        report.setdefault("cluster_sim", {})[n] = results
    write_report(report)


def replay_policies(
    args, requests: list[dict], blocks: int, kv_bytes: int, unlimited: float
) -> dict:
    """Every policy's replay with `blocks` blocks a worker, printed as a table against the pooled
    LRU and unlimited references: {"pooled_lru": ratio, "policies": {policy: replay's result}}."""
    pooled = cluster_sim.reference_hit_ratio(requests, args.workers * blocks)
    print(
        f"\n{args.workers} workers x {blocks} blocks\n"
        f"{'policy':<14}{'hit ratio':>10}{'of pooled':>10}{'of unltd':>10}{'TTFT p50':>10}{'TTFT p90':>10}"
        f"{'max/mean':>10}  requests per worker"
    )
    print(f"{'pooled LRU':<14}{pooled:>10.3f}{1:>10.2f}{pooled / unlimited:>10.2f}")
    print(f"{'unlimited':<14}{unlimited:>10.3f}{unlimited / pooled:>10.2f}{1:>10.2f}", flush=True)
    results = {}
    for policy in args.policies.split(","):
        r = results[policy] = replay(args, args.model, requests, policy, kv_bytes)
        print(
            f"{policy:<14}{r['hit_ratio']:>10.3f}{r['hit_ratio'] / pooled:>10.2f}{r['hit_ratio'] / unlimited:>10.2f}"
            f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p90_ms']:>10.1f}{r['balance']:>10.2f}  {r['requests_per_worker']}"
            + (f"  store hits: {r['store_hits']}" if "store_hits" in r else "")
            + (f"  store calls failed: {r['store_failures']}" if "store_failures" in r else "")
            + (f"  back-offs: {r['store_backoffs']}" if "store_backoffs" in r else "")
            + (f"  writes shed: {r['store_writes_dropped']}" if "store_backoffs" in r else "")
            + (f"  cached tokens by tier: {r['cached_by_tier']}" if "store_failures" in r else "")
            + f"  CPU s: {r['cpu_s']}",
            flush=True,
        )
    return {"pooled_lru": pooled, "policies": results}


def write_report(report: dict) -> None:
    os.makedirs(os.path.join(REPO_ROOT, "build"), exist_ok=True)
    with open(os.path.join(REPO_ROOT, "build", "bench-prompt-cache.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
