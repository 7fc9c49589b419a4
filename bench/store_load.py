"""Loading a stored prompt from the KV cache store against computing it, per checkpoint.

    .venv/bin/python bench/store_load.py [--tokens 900] [--repeats 5] [--checkpoints demo,small]
                                         [--backends on,mooncake]

A store and one worker (`--kv-store`), real processes, for each backend: the built-in store
(`on`, `KV_STORE=on`) or a Mooncake Store pool (`mooncake`, `KV_STORE=mooncake`: a
mooncake_master and one node, started by deploy/mooncake.py); both called over the Worker API with token
ids (so checkpoints without a tokenizer work: `small` is bench/checkpoints.py's 125M Llama,
fp32). The worker computes `--repeats` random prompts and writes them through to the store;
then a fresh worker (empty cache) starts and, after one untimed load that opens its
connection to the store (as in steady state), times the first token of each stored prompt
(loaded from the store's DRAM, or the Mooncake node's) against an equally long prompt nobody has seen (computed).
Prints the medians and their ratio; the KV bytes moved per prompt are printed beside them.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import grpc
import torch

from bench import checkpoints
from deploy.mooncake import start_master, start_node
from deploy.processes import start_service, stop
from engine.block_hash import hash_blocks
from engine.config import ModelConfig
from engine.kv_cache import bytes_per_block
from services.kvcache.mooncake_pool import SCHEME, block_key, connect
from tandem.v1 import kvcache_pb2, kvcache_pb2_grpc, worker_pb2, worker_pb2_grpc

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECKPOINTS = {
    "demo": lambda: os.path.join(REPO_ROOT, "demo", "tandem-demo"),
    "small": lambda: checkpoints.make_checkpoint("small", "float32"),
}
BLOCK = 16


def first_token_s(worker: str, prompt: list[int]) -> float:
    with grpc.insecure_channel(worker) as channel:
        started = time.perf_counter()
        call = worker_pb2_grpc.WorkerStub(channel).Generate(
            worker_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                sampling=worker_pb2.SamplingParams(max_tokens=1, temperature=0),
            ),
            timeout=120,
        )
        next(iter(call))
        elapsed = time.perf_counter() - started
        call.cancel()
        return elapsed


def wait_stored(store: str, worker: str, prompts: list[list[int]], timeout_s: float = 60) -> None:
    """Until the store (HOST:PORT, or a mooncake:// pool) holds every full block but the last
    token's of each prompt."""
    with grpc.insecure_channel(worker) as channel:
        health = worker_pb2_grpc.WorkerStub(channel).Health(worker_pb2.HealthRequest(), timeout=10)
    namespace = health.kv_store_namespace
    if store.startswith(SCHEME):
        pool = connect(store, "127.0.0.1")

        def num_stored(hashes: list[int]) -> int:
            exists = pool.batch_is_exist([block_key(namespace, h) for h in hashes])
            return sum(e == 1 for e in exists)
    else:
        stub = kvcache_pb2_grpc.KVCacheStub(grpc.insecure_channel(store))

        def num_stored(hashes: list[int]) -> int:
            lookup = kvcache_pb2.LookupRequest(namespace=namespace, block_hashes=hashes)
            return len(stub.Lookup(lookup).tiers)

    deadline = time.monotonic() + timeout_s
    for prompt in prompts:
        hashes = hash_blocks(prompt, BLOCK)[: (len(prompt) - 1) // BLOCK]
        while num_stored(hashes) < len(hashes):
            if time.monotonic() > deadline:
                raise RuntimeError("the write-through did not land")
            time.sleep(0.05)
    if store.startswith(SCHEME):
        pool.close()


def start_store(backend: str, disk_dir: str) -> tuple[list, str]:
    """The store's processes and what workers are given as `--kv-store`."""
    if backend == "mooncake":
        master, pool = start_master()
        node, _ = start_node(pool, 256 << 20)
        return [master, node], pool.kv_store
    store, address = start_service(
        "services.kvcache", "--host", "127.0.0.1", "--disk-dir", disk_dir
    )
    return [store], address


def measure(model: str, num_tokens: int, repeats: int, backend: str = "on") -> dict:
    config = ModelConfig.from_folder(model)
    rng = random.Random(0)
    stored = [
        [rng.randrange(3, config.vocab_size) for _ in range(num_tokens)] for _ in range(repeats + 1)
    ]
    fresh = [
        [rng.randrange(3, config.vocab_size) for _ in range(num_tokens)] for _ in range(repeats)
    ]
    store_dir = tempfile.TemporaryDirectory()
    processes, store_address = start_store(backend, store_dir.name)
    worker_args = ("--model", model, "--host", "127.0.0.1", "--kv-store", store_address)
    try:
        writer, address = start_service("services.worker", *worker_args)
        processes.append(writer)
        for prompt in stored:
            first_token_s(address, prompt)
        wait_stored(store_address, address, stored)
        stop(writer)
        reader, address = start_service("services.worker", *worker_args)
        processes.append(reader)
        first_token_s(address, stored[-1])  # untimed: opens the store's connection to this worker
        loaded = [first_token_s(address, prompt) for prompt in stored[:repeats]]
        computed = [first_token_s(address, prompt) for prompt in fresh]
    finally:
        for proc in reversed(processes):
            stop(proc)
        store_dir.cleanup()
    kv_bytes = bytes_per_block(
        config, BLOCK, torch.float32 if config.torch_dtype == "float32" else torch.bfloat16
    )
    kv_bytes *= num_tokens / BLOCK
    return {
        "loaded_ms": 1e3 * statistics.median(loaded),
        "computed_ms": 1e3 * statistics.median(computed),
        "kv_mib": kv_bytes / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=900)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--checkpoints", default="demo,small", help=f"from {list(CHECKPOINTS)}")
    ap.add_argument("--backends", default="on", help="the store's: on (built-in), mooncake")
    args = ap.parse_args()
    with open("/proc/cpuinfo") as f:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            "unknown",
        )
    print(
        f"CPU: {cpu}, {os.cpu_count()} cores; a {args.tokens}-token prompt, first token on a worker with an "
        f"empty cache, median of {args.repeats}"
    )
    print(
        f"{'checkpoint':<12}{'store':<10}{'KV MiB':>8}{'loaded ms':>11}{'computed ms':>13}"
        f"{'speed-up':>10}"
    )
    for name in args.checkpoints.split(","):
        for backend in args.backends.split(","):
            r = measure(CHECKPOINTS[name](), args.tokens, args.repeats, backend)
            print(
                f"{name:<12}{backend:<10}{r['kv_mib']:>8.1f}{r['loaded_ms']:>11.1f}"
                f"{r['computed_ms']:>13.1f}{r['computed_ms'] / r['loaded_ms']:>9.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
