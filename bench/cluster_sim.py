"""A fleet of simulated workers behind the gateway's real routing code, replaying a trace in
seconds: how a routing policy behaves at 4 to 64 workers.

    .venv/bin/python bench/cluster_sim.py [--workers 4,32] [--requests 0] [--blocks-per-worker 2048]
                                          [--profile cpu-demo|gpu-70b] [--policies round_robin,load,kv,kv+session]

The routing is the gateway's own objects, not a copy: the policies of
services/gateway/routing/policies/, the prefix index, the affinity table, `Endpoint` load
counters and their `InFlight` accounting. Each simulated worker has an LRU cache of
`--blocks-per-worker` blocks, which feeds the prefix index stored/evicted events as a real
worker's KV events do (instantly: the real feed lags by a step), and a cost model:
- prefill: one FIFO per worker at `prefill_tok_s` tokens a second, for the tokens its cache
  does not hold (what the engine recomputes; a prompt's last token is never cached);
- decode: the request's output tokens at `step_s(batch)` each, batch = the requests decoding
  on that worker when its prefill ends (decode runs beside prefill, as chunked prefill mixes
  them; the interference is not modelled).
Profiles: `cpu-demo`, calibrated from bench/engine_speed.py on the demo-sized model on 2 cores
(prefill ~5,400 tok/s; a decode step 4.5 ms + 0.25 ms per sequence); `gpu-70b`, published
figures for a 70B model on one 8-GPU node (prefill ~40,000 tok/s; a step 25 ms + 0.1 ms per
sequence). Trace blocks are 16 tokens, as in bench/prompt_cache.py; output lengths are the
trace's / 16, at least 1.

A policy with `+store` adds the KV cache store: the real `BlockStore` (services/kvcache/
store.py: LRU, leases, the disk admission rule, promotion) over an in-memory stand-in for its
disk tier, with STORE_DRAM_PER_WORKER x the workers' blocks of DRAM and STORE_DISK_PER_WORKER x
of disk. Every prompt's blocks the store lacks are written through; a worker loads the stored
prefix beyond its own cache (one lease, as a real `Get`) at `load_s_per_block` a block from
DRAM and `disk_load_s_per_block` from disk instead of computing it (the demo model: ~0.5 ms
measured, disk assumed 2x; the GPU figures assume RDMA at ~25 GB/s and NVMe at ~5 GB/s for
70B-sized blocks of 5 MiB), and routing credits what the store holds (the gateway's view).
`--disk-admission N` changes the rule (evicted blocks used N times go to disk): its effect is
measured by running both.

Reports per policy: hit ratio (cached prompt tokens / prompt tokens), TTFT p50/p90 and TPOT
p50 in ms, and per-worker balance: requests and prefill tokens, max over mean.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import statistics
from collections import OrderedDict

import grpc

from engine.block_hash import hash_blocks
from services.gateway.routing import policies
from services.gateway.routing.affinity import AffinityTable
from services.gateway.routing.endpoints import Endpoint, EndpointSet
from services.gateway.routing.policies import RouteRequest
from services.gateway.routing.policies.kv import DECODE_WEIGHT, PREFILL_WEIGHT
from services.gateway.routing.prefix_index import PrefixIndex
from services.kvcache.store import DISK_ADMISSION_USES, BlockStore

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BLOCK = 16
PROFILES = {
    "cpu-demo": {
        "prefill_tok_s": 5400.0,
        "step_base_s": 0.0045,
        "step_per_seq_s": 0.00025,
        "load_s_per_block": 0.0005,
        "disk_load_s_per_block": 0.001,
    },
    "gpu-70b": {
        "prefill_tok_s": 40000.0,
        "step_base_s": 0.025,
        "step_per_seq_s": 0.0001,
        "load_s_per_block": 0.0002,
        "disk_load_s_per_block": 0.001,
    },
}
# x a worker's blocks: the store's DRAM, as bench/prompt_cache.py sizes it
STORE_DRAM_PER_WORKER = 4
STORE_DISK_PER_WORKER = 16  # x a worker's blocks: its disk
NAMESPACE = "sim"


class SimDisk:
    """The disk tier's interface (services/kvcache/disk.py) over an in-memory LRU of blocks."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.files: OrderedDict = OrderedDict()
        self.num_writes = 0
        self.on_change = lambda key: None

    def __contains__(self, key) -> bool:
        return key in self.files

    def keys(self) -> list:
        return list(self.files)

    def write(self, key, data: bytes) -> bool:
        self.num_writes += 1
        self.files[key] = data
        self.files.move_to_end(key)
        while len(self.files) > self.capacity:
            self.files.popitem(last=False)
        return True

    def read(self, key):
        if key in self.files:
            self.files.move_to_end(key)
        return self.files.get(key)

    def flush(self) -> None:
        pass


def sim_store(num_blocks: int, disk_admission: int) -> BlockStore:
    """The real store over 1-byte blocks (so its byte budgets count blocks)."""
    store = BlockStore(
        STORE_DRAM_PER_WORKER * num_blocks, SimDisk(STORE_DISK_PER_WORKER * num_blocks)
    )
    store.disk_admission_uses = disk_admission
    return store


class SimWorker:
    def __init__(self, endpoint: Endpoint, index: PrefixIndex, capacity: int, profile: dict):
        self.endpoint, self.index, self.capacity, self.profile = endpoint, index, capacity, profile
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.prefill_free_at = 0.0
        self.decoding = 0
        self.requests = self.prefill_tokens = 0

    def cached_blocks(self, hashes: list[int], num_tokens: int) -> int:
        matched, cacheable = 0, min((num_tokens - 1) // BLOCK, len(hashes))
        while matched < cacheable and hashes[matched] in self.cache:
            matched += 1
        return matched

    def store(self, hashes: list[int]) -> None:
        for h in hashes:
            self.cache[h] = None
            self.cache.move_to_end(h)
        self.index.stored(self.endpoint, hashes)
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        self.index.evicted(self.endpoint, evicted)

    def step_s(self) -> float:
        return self.profile["step_base_s"] + self.profile["step_per_seq_s"] * self.decoding


DEFAULT_TRACE = os.path.join(REPO_ROOT, "bench", "traces", "mooncake_conversation_trace.jsonl")


def load_trace(num_requests: int, max_blocks: int, path: str = DEFAULT_TRACE) -> list[dict]:
    requests = []
    with open(path) as f:
        for i, line in enumerate(f):
            if num_requests and i >= num_requests:
                break
            row = json.loads(line)
            ids = row["hash_ids"][:max_blocks] if max_blocks else row["hash_ids"]
            # Trace block ids stand in for token blocks: one token per id keeps hashing cheap
            # while equal ids still chain to equal block hashes.
            # every prompt shares block 0
            requests.append(
                {
                    "at_s": row["timestamp"] / 1000,
                    "ids": ids,
                    "num_tokens": len(ids) * BLOCK,
                    "output": max(1, row["output_length"] // 16),
                    "session": "c" + "-".join(map(str, ids[:2])),
                }
            )
    for r in requests:
        r["hashes"] = hash_blocks(r["ids"], 1)
    return requests


def simulate(
    requests: list[dict],
    num_workers: int,
    policy_name: str,
    blocks_per_worker: int,
    profile: dict,
    kv_weights: tuple[float, float] = (PREFILL_WEIGHT, DECODE_WEIGHT),
    disk_admission: int = DISK_ADMISSION_USES,
) -> dict:
    router, with_session = policy_name.split("+")[0], "+session" in policy_name
    store = (
        sim_store(num_workers * blocks_per_worker, disk_admission)
        if "+store" in policy_name
        else None
    )
    index, affinity = PrefixIndex(), AffinityTable()
    policy = policies.create(router, index, *kv_weights)
    endpoints = EndpointSet({})
    channel = grpc.insecure_channel("127.0.0.1:1")  # never dialled: the stubs are unused
    fleet = []
    for i in range(num_workers):
        endpoint = Endpoint(
            f"sim-{i}",
            "both",
            channel,
            healthy=True,
            num_blocks=blocks_per_worker,
            num_free_blocks=blocks_per_worker,
            max_num_seqs=64,
        )
        fleet.append(SimWorker(endpoint, index, blocks_per_worker, profile))
    by_endpoint = {w.endpoint: w for w in fleet}
    events: list = [(r["at_s"], 0, i, "arrive") for i, r in enumerate(requests)]
    heapq.heapify(events)
    loads, ttfts, tpots, hit, total = {}, [], [], 0, 0
    while events:
        now, _, i, kind = heapq.heappop(events)
        r = requests[i]
        if kind == "arrive":
            candidates = [w.endpoint for w in fleet]
            endpoint = affinity.lookup("both", r["session"], candidates) if with_session else None
            cacheable = (r["num_tokens"] - 1) // BLOCK
            if endpoint is None:
                stored = (
                    store.lookup(NAMESPACE, r["hashes"][:cacheable]) if store is not None else []
                )
                endpoint = policy.pick(
                    "both",
                    RouteRequest(r["num_tokens"], r["output"], r["hashes"], stored_tiers=stored),
                    candidates,
                ).endpoint
            if with_session:
                affinity.remember("both", r["session"], endpoint)
            worker = by_endpoint[endpoint]
            matched = worker.cached_blocks(r["hashes"], r["num_tokens"])
            tiers = []
            if store is not None:  # the stored prefix beyond the local one is loaded, not computed
                lease = store.acquire(NAMESPACE, r["hashes"][matched:cacheable], lease_s=1.0)
                store.release(lease.id)
                tiers = lease.tiers
            loaded = len(tiers)
            load_s = sum(
                profile["disk_load_s_per_block" if t == "disk" else "load_s_per_block"]
                for t in tiers
            )
            uncached = r["num_tokens"] - (matched + loaded) * BLOCK
            hit, total = hit + (matched + loaded) * BLOCK, total + r["num_tokens"]
            worker.requests += 1
            worker.prefill_tokens += uncached
            loads[i] = endpoints.in_flight(
                endpoint,
                prefill_tokens=uncached,
                decode_tokens_after_prefill=r["num_tokens"] + r["output"],
                block_hashes=r["hashes"],
            )
            worker.prefill_free_at = (
                max(worker.prefill_free_at, now) + uncached / profile["prefill_tok_s"] + load_s
            )
            worker.store(r["hashes"])  # registered as computed (a real worker: block by block)
            if store is not None:  # written through: the blocks it lacks
                for h in r["hashes"]:
                    store.put((NAMESPACE, h), b"\0")
            heapq.heappush(events, (worker.prefill_free_at, 1, i, "prefilled"))
            r["worker"] = worker
        elif kind == "prefilled":
            worker = r["worker"]
            ttfts.append(now - r["at_s"])
            worker.decoding += 1
            loads[i].move_to_decode(r["num_tokens"] + r["output"])
            tpots.append(worker.step_s())
            heapq.heappush(events, (now + r["output"] * worker.step_s(), 2, i, "finished"))
        else:
            r["worker"].decoding -= 1
            loads.pop(i).close()
    channel.close()

    def spread(values):
        return max(values) / (sum(values) / len(values)) if sum(values) else 1.0

    ttfts.sort()
    store_figures = (
        {
            "store_hits": {"dram": store.stats.dram.hits, "disk": store.stats.disk.hits},
            "disk_writes": store.disk.num_writes,
        }
        if store is not None
        else {}
    )
    return {
        **store_figures,
        "hit_ratio": hit / total,
        "ttft_p50_ms": 1e3 * statistics.median(ttfts),
        "ttft_p90_ms": 1e3 * ttfts[int(0.9 * (len(ttfts) - 1))],
        "tpot_p50_ms": 1e3 * statistics.median(tpots),
        "requests_max_over_mean": spread([w.requests for w in fleet]),
        "prefill_tokens_max_over_mean": spread([w.prefill_tokens for w in fleet]),
    }


def reference_hit_ratio(requests: list[dict], capacity: int | None) -> float:
    """One LRU of `capacity` blocks (None: unlimited) serving every request: the bound a fleet
    reaches when it behaves as one cache."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in sorted(requests, key=lambda r: r["at_s"]):
        matched, cacheable = 0, min((r["num_tokens"] - 1) // BLOCK, len(r["hashes"]))
        while matched < cacheable and r["hashes"][matched] in cache:
            matched += 1
        hit, total = hit + matched * BLOCK, total + r["num_tokens"]
        for h in r["hashes"]:
            cache[h] = None
            cache.move_to_end(h)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return hit / total


def print_table(results: dict[str, dict], title: str) -> None:
    print(f"\n{title}")
    print(
        f"{'policy':<14}{'hit ratio':>10}{'TTFT p50':>10}{'TTFT p90':>10}{'TPOT p50':>10}{'req max/mean':>14}"
        f"{'prefill max/mean':>18}"
    )
    for name, r in results.items():
        print(
            f"{name:<14}{r['hit_ratio']:>10.3f}{r['ttft_p50_ms']:>10.1f}{r['ttft_p90_ms']:>10.1f}"
            f"{r['tpot_p50_ms']:>10.2f}{r['requests_max_over_mean']:>14.2f}{r['prefill_tokens_max_over_mean']:>18.2f}"
            + (
                f"  store hits {r['store_hits']}, disk writes {r['disk_writes']}"
                if "store_hits" in r
                else ""
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", default="4,32")
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="JSONL in the Mooncake trace's format")
    ap.add_argument("--requests", type=int, default=0, help="first N trace rows (0: all)")
    ap.add_argument("--max-blocks", type=int, default=0, help="prompt blocks kept (0: all)")
    ap.add_argument("--blocks-per-worker", type=int, default=2048)
    ap.add_argument("--profile", default="cpu-demo", choices=sorted(PROFILES))
    ap.add_argument("--time-scale", type=float, default=1.0, help="x the trace's arrival times")
    ap.add_argument("--policies", default="round_robin,load,kv,kv+session,kv+store")
    ap.add_argument("--kv-prefill-weight", type=float, default=PREFILL_WEIGHT)
    ap.add_argument("--kv-decode-weight", type=float, default=DECODE_WEIGHT)
    ap.add_argument(
        "--disk-admission",
        type=int,
        default=DISK_ADMISSION_USES,
        help="+store: evicted blocks used this many times go to disk",
    )
    args = ap.parse_args()
    requests = load_trace(args.requests, args.max_blocks, args.trace)
    for r in requests:
        r["at_s"] *= args.time_scale
    for n in (int(w) for w in args.workers.split(",")):
        results = {
            p: simulate(
                requests,
                n,
                p,
                args.blocks_per_worker,
                PROFILES[args.profile],
                (args.kv_prefill_weight, args.kv_decode_weight),
                args.disk_admission,
            )
            for p in args.policies.split(",")
        }
        print_table(
            results,
            f"{n} workers x {args.blocks_per_worker} blocks, {len(requests)} requests, "
            f"profile {args.profile}",
        )
        print(
            f"references: one pooled LRU of {n * args.blocks_per_worker} blocks "
            f"{reference_hit_ratio(requests, n * args.blocks_per_worker):.3f}, "
            f"unlimited {reference_hit_ratio(requests, None):.3f}"
        )


if __name__ == "__main__":
    main()
