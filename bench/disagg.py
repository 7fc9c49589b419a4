"""Disaggregated serving against colocated, on the same cores, under a trace-shaped mixed load.

    .venv/bin/python bench/disagg.py [--requests 80] [--time-scale 1] [--transport ucx] [--prefill-threads 2]

Workload: the first `--requests` rows of bench/traces/mooncake_conversation_trace.jsonl
(Mooncake's production conversation trace: arrival time, input and output length), scaled
down for this machine and the demo model's 1024-token context: arrival times x `--time-scale`,
input lengths / 16 (capped at 768), output lengths / 4 (capped at 192). Long prompts keep
arriving while earlier requests decode. Prompts are random text (no prefix-cache hits), the
output is greedy with `ignore_eos`, so every request generates exactly its output length.

Topologies, each started fresh through deploy/stack.py on the same two cores:
- colocated: 2 workers that each prefill and decode, one thread each (the baseline);
- disaggregated: 1 prefill worker (`--prefill-threads`, 2: prefill is compute-bound and may
  use what the decode worker leaves idle) + 1 decode worker (one thread), KV over `--transport`.
Clients stream completions from the gateway over gRPC at the trace's arrival times.

Prints p50/p90 TTFT, p50/p90 time per output token (TPOT: a request's decode time over its
tokens after the first) and inter-token latency, output tokens/s, and ratios; then the KV
transfer throughput of bench/kv_transfer.py.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

import grpc
import psutil

from bench import kv_transfer
from deploy.stack import start_stack
from engine.tokenizer import Tokenizer
from tandem.v1 import inference_pb2, inference_pb2_grpc

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRACE = os.path.join(REPO_ROOT, "bench", "traces", "mooncake_conversation_trace.jsonl")
MODEL = os.path.join(REPO_ROOT, "demo", "tandem-demo")
INPUT_SCALE, MAX_INPUT = 1 / 16, 768
OUTPUT_SCALE, MAX_OUTPUT = 1 / 4, 192


@dataclass
class Request:
    arrival_s: float
    prompt: str
    num_prompt_tokens: int
    max_tokens: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    error: str = ""


def workload(
    tokenizer: Tokenizer, n: int, time_scale: float, context: int, seed: int = 0
) -> list[Request]:
    rng = random.Random(seed)
    words = [w for w in (tokenizer.decode([i]).strip() for i in range(300, 2000)) if w.isalpha()]
    requests = []
    with open(TRACE) as f:
        rows = [json.loads(next(f)) for _ in range(n)]
    for row in rows:
        target = max(16, min(MAX_INPUT, round(row["input_length"] * INPUT_SCALE)))
        text = ""
        while len(tokenizer.encode(text)) < target:  # random words up to the target length
            text += " ".join(rng.choice(words) for _ in range(16)) + " "
        num_prompt = len(tokenizer.encode(text, add_special_tokens=True))
        max_tokens = max(
            2, min(MAX_OUTPUT, round(row["output_length"] * OUTPUT_SCALE), context - num_prompt)
        )
        requests.append(Request(row["timestamp"] / 1000 * time_scale, text, num_prompt, max_tokens))
    return requests


def run_one(stub, request: Request) -> None:
    call = inference_pb2.CompletionRequest(
        prompt=request.prompt,
        max_tokens=request.max_tokens,
        temperature=0,
        ignore_eos=True,
        stream_options=inference_pb2.StreamOptions(include_usage=True),
    )
    request.sent = time.perf_counter()
    try:
        for chunk in stub.StreamCompletion(call, timeout=600):
            if chunk.choices and chunk.choices[0].text:
                request.token_times.append(time.perf_counter())
            if chunk.HasField("usage"):
                request.num_output_tokens = chunk.usage.completion_tokens
    except grpc.RpcError as exc:
        request.error = f"{exc.code().name}: {exc.details()}"


def replay(stub, requests: list[Request]) -> float:
    """Sends each request at its arrival time; returns the wall time until the last finished."""
    threads = []
    start = time.perf_counter()
    for request in requests:
        time.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
        thread = threading.Thread(target=run_one, args=(stub, request), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=900)
    return time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def summarize(requests: list[Request], wall_s: float) -> dict[str, float]:
    done = [r for r in requests if not r.error and r.token_times]
    ttft = [(r.token_times[0] - r.sent) * 1e3 for r in done]
    tpot = [
        (r.token_times[-1] - r.token_times[0]) * 1e3 / (r.num_output_tokens - 1)
        for r in done
        if r.num_output_tokens > 1
    ]
    itl = [(b - a) * 1e3 for r in done for a, b in zip(r.token_times, r.token_times[1:])]
    return {
        "TTFT p50 (ms)": percentile(ttft, 0.5),
        "TTFT p90 (ms)": percentile(ttft, 0.9),
        "TPOT p50 (ms)": percentile(tpot, 0.5),
        "TPOT p90 (ms)": percentile(tpot, 0.9),
        "ITL p50 (ms)": percentile(itl, 0.5),
        "ITL p90 (ms)": percentile(itl, 0.9),
        "ITL p99 (ms)": percentile(itl, 0.99),
        "output tok/s": sum(r.num_output_tokens for r in done) / wall_s,
        "failed": len(requests) - len(done),
    }


def measure(topology: str, tokenizer: Tokenizer, args) -> dict[str, float]:
    requests = workload(tokenizer, args.requests, args.time_scale, context=1024)
    stack = start_stack(
        MODEL,
        topology=topology,
        num_workers=2,
        num_prefill=args.prefill,
        num_decode=args.decode,
        worker_args=("--kv-transport", args.transport),
        role_args={"prefill": ("--max-num-batched-tokens", str(args.prefill_budget))},
        worker_env={
            "both": {"OMP_NUM_THREADS": "1"},
            "decode": {"OMP_NUM_THREADS": "1"},
            "prefill": {"OMP_NUM_THREADS": str(args.prefill_threads)},
        },
    )
    try:
        with grpc.insecure_channel(stack.gateway_address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for warm in workload(
                tokenizer, 2, 0.0, context=1024, seed=1
            ):  # first-call costs, both workers
                run_one(stub, warm)
            procs = {a: psutil.Process(p.pid) for a, p in stack.worker_processes.items()}
            cpu_before = {a: sum(p.cpu_times()[:2]) for a, p in procs.items()}
            wall_s = replay(stub, requests)
            cpu = {a: sum(p.cpu_times()[:2]) - cpu_before[a] for a, p in procs.items()}
    finally:
        stack.stop()
    results = summarize(requests, wall_s)
    for role, addresses in stack.workers.items():  # where the cores went
        if addresses:
            results[f"{role} CPU s"] = sum(cpu[a] for a in addresses)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=80)
    ap.add_argument("--time-scale", type=float, default=1.0, help="x the trace's arrival times")
    ap.add_argument("--transport", default="ucx", choices=["ucx", "tcp", "mooncake"])
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers")
    ap.add_argument("--decode", type=int, default=1, help="decode workers")
    ap.add_argument(
        "--prefill-threads",
        type=int,
        default=2,
        help="prefill is compute-bound: its threads may use the core decode leaves idle",
    )
    ap.add_argument(
        "--prefill-budget", type=int, default=512, help="prefill worker's tokens per step"
    )
    ap.add_argument(
        "--skip-transfer", action="store_true", help="leave out the KV transfer throughput part"
    )
    args = ap.parse_args()
    tokenizer = Tokenizer(MODEL)
    sample = workload(tokenizer, args.requests, args.time_scale, context=1024)
    print(
        f"workload: {len(sample)} requests over {sample[-1].arrival_s:.1f}s; prompt tokens mean "
        f"{statistics.mean(r.num_prompt_tokens for r in sample):.0f} (max {max(r.num_prompt_tokens for r in sample)}), "
        f"output tokens mean {statistics.mean(r.max_tokens for r in sample):.0f}",
        flush=True,
    )
    results = {}
    for topology in ("colocated", "disaggregated"):
        print(f"running {topology} ...", flush=True)
        results[topology] = measure(topology, tokenizer, args)
    colo, disagg = results["colocated"], results["disaggregated"]
    print(
        f"\n{'':16}{'colocated (2)':>16}{f'disagg ({args.prefill}P+{args.decode}D)':>16}{'disagg/colo':>13}"
    )
    for key in dict.fromkeys([*colo, *disagg]):
        if key not in colo or key not in disagg:
            value = colo.get(key, disagg.get(key))
            print(
                f"{key:16}"
                + (f"{value:>16.1f}{'':>16}" if key in colo else f"{'':>16}{value:>16.1f}")
            )
            continue
        ratio = f"{disagg[key] / colo[key]:>12.2f}x" if colo[key] else f"{'-':>13}"
        print(f"{key:16}{colo[key]:>16.1f}{disagg[key]:>16.1f}{ratio}")
    print(
        f"\np90 TPOT: {colo['TPOT p90 (ms)'] / disagg['TPOT p90 (ms)']:.2f}x better disaggregated (goal: >= 3x)"
    )
    print(
        f"p90 TTFT: {disagg['TTFT p90 (ms)'] / colo['TTFT p90 (ms)']:.2f}x colocated's (goal: <= 1.2x)"
    )
    if not args.skip_transfer:
        print()
        print(kv_transfer.report(kv_transfer.run()))


if __name__ == "__main__":
    main()
