"""Serving overhead: the worker called directly against the same worker behind gateway + Envoy.

    .venv/bin/python bench/gateway.py [--model demo/tandem-demo] [--requests 20] [--max-tokens 32]
                                      [--concurrency 8] [--seconds 10] [--streams 2000] [--burst 2000]
                                      [--auth 6] [--skip-paths]

Starts one worker, a gateway and Envoy (deploy/stack.py, as `make run` does) and measures, in one run:
- TTFT and inter-token latency (p50/p90) of a streamed chat completion, one request at a time,
  on three paths: worker gRPC `Generate` (prompt already tokenized: the floor), gateway gRPC
  through Envoy, and OpenAI HTTP + SSE through Envoy. Greedy, same prompt, `--max-tokens`.
- Requests/s with short prompts (max_tokens=1) from `--concurrency` client threads for
  `--seconds`, worker direct against OpenAI HTTP through Envoy.
- `--burst N`: N concurrent streamed chats (max_tokens 16-32) through Envoy on the default
  settings: how many end in `[DONE]`, how many were refused, the wall time.
- `--streams N`: the gateway alone, in front of bench/stub_worker.py (the Worker API with no
  engine: it paces tokens itself, so N streams cost the worker nothing). With N streams held
  open (one token a second each), probe streams measure TTFT and inter-token latency (p50,
  p99) worker-direct and through Envoy + gateway; the difference is the gateway's added
  latency. The gateway's RSS with the streams open, less its RSS before, over N is its
  memory per open stream.
- `--auth N`: what API keys cost. Two gateways in front of one stub worker, keys off and on,
  requests/s of short streamed chats from `--concurrency` clients in N alternating rounds.
Prints ratios (path / worker). Loopback only; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time

import grpc
import psutil

from deploy.envoy.render import render, start_envoy
from deploy.processes import free_port, named_address, start_service, stop
from deploy.stack import start_stack
from engine.tokenizer import Tokenizer
from tandem.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MESSAGES = [{"role": "user", "content": "Hello! What can you do?"}]


def timings(arrivals: list[float], start: float) -> tuple[float, list[float]]:
    """TTFT and the gaps between later arrivals, in ms."""
    return (arrivals[0] - start) * 1e3, [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]


def worker_stream(stub, prompt_ids: list[int], max_tokens: int) -> list[float]:
    request = worker_pb2.GenerateRequest(
        prompt_token_ids=prompt_ids,
        sampling=worker_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    return [time.perf_counter() for r in stub.Generate(request, timeout=60) if r.token_ids]


def gateway_stream(stub, max_tokens: int) -> list[float]:
    request = inference_pb2.ChatCompletionRequest(max_tokens=max_tokens, temperature=0)
    for m in MESSAGES:
        message = request.messages.add(role=m["role"])
        message.content.string_value = m["content"]
    return [
        time.perf_counter()
        for c in stub.StreamChatCompletion(request, timeout=60)
        if c.choices and c.choices[0].delta.content
    ]


def openai_stream(address: str, max_tokens: int, api_key: str = "") -> list[float]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    headers = {
        "Content-Type": "application/json",
        **({"Authorization": f"Bearer {api_key}"} if api_key else {}),
    }
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    response, arrivals = conn.getresponse(), []
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read(300)!r}")
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
    q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    return {
        "path": name,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": q(ttfts, 90),
        "ttft_p99": q(ttfts, 99),
        "itl_p50": statistics.median(gaps),
        "itl_p90": q(gaps, 90),
        "itl_p99": q(gaps, 99),
    }


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


async def sse_chat(
    address: str, max_tokens: int, top_k: int = 0, timeout_s: float = 600
) -> tuple[int, bytes]:
    """One streamed chat over a raw asyncio connection: (HTTP status, the last `data:` line)."""
    host, port = address.split(":")
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    try:
        body = json.dumps(
            {
                "messages": MESSAGES,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
                "top_k": top_k,
            }
        ).encode()
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        status = int((await asyncio.wait_for(reader.readline(), timeout_s)).split()[1])
        last = b""
        while True:
            line = await asyncio.wait_for(reader.readline(), timeout_s)
            if not line:
                return status, last
            if line.startswith(b"data: "):
                last = line[6:].strip()
                if last == b"[DONE]":
                    return status, last
            elif status != 200 and line.startswith(b"{"):
                return status, line.strip()
    finally:
        writer.close()


def run_streams(address: str, n: int, max_tokens: int, top_k: int, results) -> None:
    """N concurrent streams (in a process of its own); `results` gets (status, last line) per
    stream. `max_tokens` 0: each stream draws its own from 16-32."""

    async def all_streams():
        async def one():
            try:
                return await sse_chat(address, max_tokens or random.randint(16, 32), top_k)
            except (TimeoutError, OSError, ValueError, IndexError) as exc:
                return 0, repr(exc).encode()

        return await asyncio.gather(*(one() for _ in range(n)))

    results.extend(asyncio.run(all_streams()))


def start_streams(address: str, n: int, max_tokens: int, top_k: int):
    ctx = multiprocessing.get_context("spawn")
    manager = ctx.Manager()
    results = manager.list()
    process = ctx.Process(
        target=run_streams, args=(address, n, max_tokens, top_k, results), daemon=True
    )
    process.start()
    return process, results, manager


def burst(model: str, n: int) -> None:
    """`--burst`: N concurrent streamed chats against the default stack (what `make run` starts)."""
    stack = start_stack(model)
    try:
        started = time.perf_counter()
        process, results, manager = start_streams(stack.envoy_address, n, 0, 0)
        process.join(timeout=1800)
        wall = time.perf_counter() - started
        results = list(results)
        done = sum(1 for status, last in results if status == 200 and last == b"[DONE]")
        refused = sum(1 for status, _ in results if status in (429, 503))
        print(
            f"\nburst: {n} concurrent streamed chats (max_tokens 16-32) through Envoy, default settings"
        )
        print(
            f"ended in [DONE]: {done}/{n}   refused: {refused}   other: {n - done - refused}   wall: {wall:.1f} s"
        )
        manager.shutdown()
    finally:
        stack.stop()


def gateway_alone(model: str, n: int, requests: int) -> None:
    """`--streams`: the gateway's added latency and memory with N streams open (stub worker)."""
    stub, stub_address = start_service("bench.stub_worker")
    gateway = envoy = None
    tmp = tempfile.TemporaryDirectory()
    try:
        gateway, grpc_address = start_service(
            "services.gateway", "--model", model, "--workers", stub_address
        )
        http_address = named_address(gateway, "openai")
        port, admin = free_port(), free_port()
        envoy = start_envoy(
            render(port, admin, grpc_address, http_address),
            tmp.name,
            admin,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        envoy_address = f"127.0.0.1:{port}"
        stub_stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(stub_address))
        prompt = Tokenizer(model).encode("x")

        def probes() -> tuple[dict, dict]:
            direct = measure_latency(
                "direct", lambda: worker_stream(stub_stub, prompt, 32), requests
            )
            via = measure_latency("via", lambda: openai_stream(envoy_address, 32), requests)
            return direct, via

        idle_direct, idle_via = probes()
        rss_before = psutil.Process(gateway.pid).memory_info().rss
        # open for ~2 minutes
        process, results, manager = start_streams(envoy_address, n, 120, 1000)
        deadline = time.monotonic() + 120
        while metric(http_address, "tandem:num_requests_running") < n:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"only {metric(http_address, 'tandem:num_requests_running'):.0f} of {n} streams opened"
                )
            time.sleep(0.5)
        rss_open = psutil.Process(gateway.pid).memory_info().rss
        load_direct, load_via = probes()
        print(
            f"\ngateway alone (stub worker), {requests} probe streams of 32 tokens, p50 / p99 (ms)"
        )
        print(f"{'':<34}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}")
        for name, direct, via in (
            ("idle", idle_direct, idle_via),
            (f"{n} streams open", load_direct, load_via),
        ):
            for label, row in (("worker direct", direct), ("Envoy + gateway", via)):
                print(
                    f"{name + ', ' + label:<34}{row['ttft_p50']:>10.2f}{row['ttft_p99']:>10.2f}"
                    f"{row['itl_p50']:>10.2f}{row['itl_p99']:>10.2f}"
                )
            print(
                f"{name + ', added by the gateway':<34}{via['ttft_p50'] - direct['ttft_p50']:>10.2f}"
                f"{via['ttft_p99'] - direct['ttft_p99']:>10.2f}{via['itl_p50'] - direct['itl_p50']:>10.2f}"
                f"{via['itl_p99'] - direct['itl_p99']:>10.2f}"
            )
        print(
            f"gateway RSS: {rss_before / 2**20:.0f} MiB idle, {rss_open / 2**20:.0f} MiB with {n} streams open: "
            f"{(rss_open - rss_before) / n / 1024:.1f} KiB per stream"
        )
        process.kill()
        manager.shutdown()
    finally:
        for proc in (envoy, gateway, stub):
            if proc is not None:
                stop(proc)
        tmp.cleanup()


def auth_cost(model: str, rounds: int, threads: int, seconds: float) -> None:
    """`--auth`: what API keys cost the gateway. Two gateways in front of one stub worker, one
    with a keys file (limits set, never reached); short streamed chats (max_tokens 1) from
    `threads` clients, in alternating rounds of `seconds`, so load on the machine hits both."""
    from services.gateway.api_keys import add_key

    stub, stub_address = start_service("bench.stub_worker")
    gateways = []
    tmp = tempfile.TemporaryDirectory()
    try:
        key = add_key(
            os.path.join(tmp.name, "keys.json"),
            "bench",
            requests_per_minute=10**9,
            tokens_per_minute=10**12,
        )
        for extra in ((), ("--api-keys-file", os.path.join(tmp.name, "keys.json"))):
            proc, _ = start_service(
                "services.gateway", "--model", model, "--workers", stub_address, *extra
            )
            gateways.append((proc, named_address(proc, "openai")))
        (_, plain), (_, keyed) = gateways
        rates: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(rounds):
            rates["off"].append(
                measure_throughput(lambda: openai_stream(plain, 1), threads, seconds)
            )
            rates["on"].append(
                measure_throughput(lambda: openai_stream(keyed, 1, key), threads, seconds)
            )
        off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
        print(
            f"\nAPI keys (stub worker, {threads} clients, max_tokens=1, {rounds} alternating rounds of "
            f"{seconds:.0f} s; median)"
        )
        print(
            f"keys off    {off:8.1f} req/s   rounds: {', '.join(f'{r:.0f}' for r in rates['off'])}"
        )
        print(
            f"keys on     {on:8.1f} req/s   rounds: {', '.join(f'{r:.0f}' for r in rates['on'])}   ({on / off:.3f}x)"
        )
    finally:
        for proc in [p for p, _ in gateways] + [stub]:
            stop(proc)
        tmp.cleanup()


def metric(address: str, name: str) -> float:
    conn = http.client.HTTPConnection(*address.split(":"), timeout=10)
    conn.request("GET", "/metrics")
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=os.path.join(REPO_ROOT, "demo", "tandem-demo"))
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument(
        "--streams",
        type=int,
        default=2000,
        help="streams held open for the gateway-alone figures (0: skip)",
    )
    ap.add_argument(
        "--burst", type=int, default=2000, help="concurrent chats on the default stack (0: skip)"
    )
    ap.add_argument(
        "--skip-paths", action="store_true", help="only the --streams, --burst and --auth sections"
    )
    ap.add_argument(
        "--auth", type=int, default=6, help="alternating rounds, keys off and on (0: skip)"
    )
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores")
    if not args.skip_paths:
        paths(args)
    if args.auth:
        auth_cost(args.model, args.auth, args.concurrency, args.seconds / 2)
    if args.streams:
        gateway_alone(args.model, args.streams, args.requests)
    if args.burst:
        burst(args.model, args.burst)


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            "unknown",
        )


def paths(args) -> None:
    stack = start_stack(args.model)
    try:
        worker_address, envoy_address = stack.worker_addresses[0], stack.envoy_address
        tokenizer = Tokenizer(args.model)
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
        worker_stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(worker_address))
        gateway_stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(envoy_address))
        rows = [
            measure_latency(
                "worker gRPC (direct)",
                lambda: worker_stream(worker_stub, prompt_ids, args.max_tokens),
                args.requests,
            ),
            measure_latency(
                "gateway gRPC via Envoy",
                lambda: gateway_stream(gateway_stub, args.max_tokens),
                args.requests,
            ),
            measure_latency(
                "OpenAI SSE via Envoy",
                lambda: openai_stream(envoy_address, args.max_tokens),
                args.requests,
            ),
        ]
        base = rows[0]
        print(
            f"\nstreamed chat, {args.max_tokens} tokens, {args.requests} sequential requests (ms)"
        )
        print(
            f"{'path':<26}{'TTFT p50':>10}{'TTFT p90':>10}{'ITL p50':>10}{'ITL p90':>10}{'TTFT x':>9}{'ITL x':>8}"
        )
        for r in rows:
            print(
                f"{r['path']:<26}{r['ttft_p50']:>10.2f}{r['ttft_p90']:>10.2f}{r['itl_p50']:>10.2f}{r['itl_p90']:>10.2f}"
                f"{r['ttft_p50'] / base['ttft_p50']:>8.2f}x{r['itl_p50'] / base['itl_p50']:>7.2f}x"
            )

        short = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]))
        direct = measure_throughput(
            lambda: worker_stream(worker_stub, short, 1), args.concurrency, args.seconds
        )
        via = measure_throughput(
            lambda: openai_stream(envoy_address, 1), args.concurrency, args.seconds
        )
        print(
            f"\nshort prompts, max_tokens=1, {args.concurrency} clients, {args.seconds:.0f} s each"
        )
        print(f"worker gRPC (direct)     {direct:8.1f} req/s")
        print(f"OpenAI HTTP via Envoy    {via:8.1f} req/s  ({via / direct:.2f}x)")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
