"""Serving overhead: the worker called directly against the same worker behind gateway + Envoy.

    .venv/bin/python bench/gateway.py [--model demo/tandem-demo] [--requests 20] [--max-tokens 32]
                                      [--concurrency 8] [--seconds 10]

Starts one worker, a gateway and Envoy (deploy/stack.py, as `make run` does) and measures, in one run:
- TTFT and inter-token latency (p50/p90) of a streamed chat completion, one request at a time,
  on three paths: worker gRPC `Generate` (prompt already tokenized: the floor), gateway gRPC
  through Envoy, and OpenAI HTTP + SSE through Envoy. Greedy, same prompt, `--max-tokens`.
- Requests/s with short prompts (max_tokens=1) from `--concurrency` client threads for
  `--seconds`, worker direct against OpenAI HTTP through Envoy.
Prints ratios (path / worker). Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import grpc  # noqa: E402

import services  # noqa: E402,F401
from deploy.stack import start_stack  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402
from tandem.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402

MESSAGES = [{"role": "user", "content": "Hello! What can you do?"}]


def timings(arrivals: list[float], start: float) -> tuple[float, list[float]]:
    """TTFT and the gaps between later arrivals, in ms."""
    return (arrivals[0] - start) * 1e3, [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]


def worker_stream(stub, prompt_ids: list[int], max_tokens: int) -> list[float]:
    request = worker_pb2.GenerateRequest(prompt_token_ids=prompt_ids, sampling=worker_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return [time.perf_counter() for r in stub.Generate(request, timeout=60) if r.token_ids]


def gateway_stream(stub, max_tokens: int) -> list[float]:
    request = inference_pb2.ChatCompletionRequest(max_tokens=max_tokens, temperature=0)
    for m in MESSAGES:
        message = request.messages.add(role=m["role"])
        message.content.string_value = m["content"]
    return [time.perf_counter() for c in stub.StreamChatCompletion(request, timeout=60)
            if c.choices and c.choices[0].delta.content]


def openai_stream(address: str, max_tokens: int) -> list[float]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response, arrivals = conn.getresponse(), []
    for line in response:
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    conn.close()
    return arrivals


def measure_latency(name: str, call, n: int) -> dict:
    call()  # warm-up
    ttfts, gaps = [], []
    for _ in range(n):
        start = time.perf_counter()
        ttft, itl = timings(call(), start)
        ttfts.append(ttft)
        gaps += itl
    q = lambda xs, p: statistics.quantiles(xs, n=10)[p - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    return {"path": name, "ttft_p50": statistics.median(ttfts), "ttft_p90": q(ttfts, 9),
            "itl_p50": statistics.median(gaps), "itl_p90": q(gaps, 9)}


def measure_throughput(call, threads: int, seconds: float) -> float:
    done, stop_at = [0] * threads, time.perf_counter() + seconds

    def client(i: int):
        while time.perf_counter() < stop_at:
            call()
            done[i] += 1

    workers = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return sum(done) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO_ROOT, "demo", "tandem-demo"))
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()

    stack = start_stack(args.model)
    try:
        worker_address, envoy_address = stack.worker_addresses[0], stack.envoy_address
        tokenizer = Tokenizer(args.model)
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
        worker_stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker_address))
        gateway_stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(envoy_address))
        rows = [
            measure_latency("worker gRPC (direct)", lambda: worker_stream(worker_stub, prompt_ids, args.max_tokens), args.requests),
            measure_latency("gateway gRPC via Envoy", lambda: gateway_stream(gateway_stub, args.max_tokens), args.requests),
            measure_latency("OpenAI SSE via Envoy", lambda: openai_stream(envoy_address, args.max_tokens), args.requests),
        ]
        base = rows[0]
        print(f"\nstreamed chat, {args.max_tokens} tokens, {args.requests} sequential requests (ms)")
        print(f"{'path':<26}{'TTFT p50':>10}{'TTFT p90':>10}{'ITL p50':>10}{'ITL p90':>10}{'TTFT x':>9}{'ITL x':>8}")
        for r in rows:
            print(f"{r['path']:<26}{r['ttft_p50']:>10.2f}{r['ttft_p90']:>10.2f}{r['itl_p50']:>10.2f}{r['itl_p90']:>10.2f}"
                  f"{r['ttft_p50'] / base['ttft_p50']:>8.2f}x{r['itl_p50'] / base['itl_p50']:>7.2f}x")

        short = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]))
        direct = measure_throughput(lambda: worker_stream(worker_stub, short, 1), args.concurrency, args.seconds)
        via = measure_throughput(lambda: openai_stream(envoy_address, 1), args.concurrency, args.seconds)
        print(f"\nshort prompts, max_tokens=1, {args.concurrency} clients, {args.seconds:.0f} s each")
        print(f"worker gRPC (direct)     {direct:8.1f} req/s")
        print(f"OpenAI HTTP via Envoy    {via:8.1f} req/s  ({via / direct:.2f}x)")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
