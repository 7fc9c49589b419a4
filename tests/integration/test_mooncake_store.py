"""Mooncake Store as the cluster KV tier, with real processes: a mooncake_master and two store
nodes. A prompt computed by one worker is served from the pool to a worker with an empty cache
(cached_tokens = its full blocks, the same greedy output), its blocks stored under tandem's
namespaced chained block hashes; a store node killed under load costs no request, and with two
replicas the blocks it held are served from the other node; no worker KV block stays held.
With disk tiers, a prefix pushed out of the pool's DRAM is served from a node's disk."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deploy.mooncake import start_master, start_node
from deploy.processes import REPO_ROOT, stop
from deploy.stack import start_stack
from engine.block_hash import hash_blocks
from services.gateway.routing.mooncake_view import MooncakeView
from services.kvcache.mooncake_pool import block_key, connect
from tandem.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.test_kv_store import (
    BLOCK,
    HANG_GUARD_S,
    PROMPT,
    WORKER_ARGS,
    assert_no_block_held,
    by_tier,
    complete,
    wait_until,
)
from tests.offline import cut_network

NODE_BYTES = 64 << 20
DISK_TEST_NODE_BYTES = 16 << 20  # small, so the test's own objects fill it
DISK_TEST_DISK_BYTES = 512 << 20  # each node's; the test writes far less
FILLER_BYTES = 64 << 10
LEASE_S = 10  # mooncake_master's --default_kv_lease_ttl: a block read or asked for stays
NUM_BLOCKS = (len(PROMPT) - 1) // BLOCK  # the prompt's full blocks a worker loads


def assert_a_new_worker_is_served_from_the_pool(stack, model, cold) -> dict:
    """A fresh worker gets the whole stored prefix from Mooncake, and the same text as `cold`;
    returns its reply."""
    replace_worker(stack, model)
    warm = complete(stack.openai_address, PROMPT)
    assert by_tier(warm) == {
        "local": 0,
        "store_dram": 0,
        "store_disk": 0,
        "mooncake_dram": NUM_BLOCKS * BLOCK,
        "mooncake_disk": 0,
    }
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    return warm


@pytest.fixture
def pool_client():
    """Connects a Mooncake client of the test's own (no memory in the pool) to a pool."""
    clients = []

    def pool_of(kv_store: str):
        client = connect(kv_store, "127.0.0.1")
        clients.append(client)
        return client

    try:
        yield pool_of
    finally:
        for client in clients:
            client.close()


def worker_health(address: str) -> worker_pb2.HealthResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Health(worker_pb2.HealthRequest(), timeout=5)


def prompt_keys(stack) -> list[str]:
    """The pool's keys of PROMPT's whole blocks, in the stack's worker's namespace."""
    [worker] = stack.workers["both"]
    namespace = worker_health(worker).kv_store_namespace
    return [block_key(namespace, h) for h in hash_blocks(PROMPT, BLOCK)[:NUM_BLOCKS]]


def written_through(stack, pool_client) -> tuple[list[str], object]:
    """PROMPT's keys once the worker that computed it has written them all to the pool, and a
    client of the pool."""
    keys, pool = prompt_keys(stack), pool_client(stack.mooncake_master.kv_store)
    wait_until(lambda: set(pool.batch_is_exist(keys)) == {1}, "the write-through to land")
    return keys, pool


def replace_worker(stack, model: str) -> str:
    """Kills the stack's worker and serves from a new one on the same pool, its cache empty."""
    [old] = stack.workers["both"]
    stack.worker_processes[old].kill()
    new = stack.start_worker(
        "both",
        model,
        "--host",
        "127.0.0.1",
        *WORKER_ARGS,
        "--kv-store",
        stack.mooncake_master.kv_store,
    )
    stack.workers["both"].remove(old)
    stack.write_workers_file()

    def routable():
        with grpc.insecure_channel(stack.gateway_address) as channel:
            health = inference_pb2_grpc.InferenceStub(channel).Health(
                inference_pb2.HealthCheckRequest(), timeout=5
            )
        return {w.address for w in health.workers if w.healthy} == {new}

    wait_until(routable, "the new worker to be the only one routed to")
    return new


def test_a_new_worker_is_served_the_prefix_from_the_mooncake_pool(chat_checkpoint, pool_client):
    model = str(chat_checkpoint)
    stack = start_stack(model, worker_args=WORKER_ARGS, mooncake=(2, NODE_BYTES, 1))
    try:
        assert len(stack.mooncake_nodes) == 2
        cold = complete(stack.openai_address, PROMPT)
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        keys, pool = written_through(stack, pool_client)

        warm = assert_a_new_worker_is_served_from_the_pool(stack, model, cold)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == NUM_BLOCKS * BLOCK
        assert_no_block_held(stack)
    finally:
        stack.stop()


def test_a_store_node_killed_under_load_costs_no_request_and_hits_come_from_the_other(
    chat_checkpoint, pool_client
):
    model = str(chat_checkpoint)
    stack = start_stack(model, worker_args=WORKER_ARGS, mooncake=(2, NODE_BYTES, 2))
    try:
        cold = complete(stack.openai_address, PROMPT)
        keys, pool = written_through(stack, pool_client)
        assert {len(pool.get_replica_desc(key)) for key in keys} == {2}

        prompts = [[(i * 7 + k) % 370 + 3 for i in range(6 * BLOCK + 3)] for k in range(12)]
        with ThreadPoolExecutor(4) as pool_of_requests:
            replies = [pool_of_requests.submit(complete, stack.openai_address, p) for p in prompts]
            replies[2].result()
            stack.mooncake_nodes[0].send_signal(signal.SIGKILL)
            assert all(r.result()["choices"][0]["text"] for r in replies)

        # The master forgets the dead node's replicas (its client TTL), and the other serves.
        wait_until(
            lambda: {len(pool.get_replica_desc(key)) for key in keys} == {1},
            "the master to drop the dead node's replicas",
        )
        assert_a_new_worker_is_served_from_the_pool(stack, model, cold)
        assert_no_block_held(stack)
    finally:
        stack.stop()


@pytest.fixture
def pool():
    """A mooncake_master and two store nodes, stopped after the test: the pool's Master."""
    processes = []
    try:
        master_proc, master = start_master()
        processes.append(master_proc)
        for _ in range(2):
            processes.append(start_node(master, NODE_BYTES)[0])
        yield master
    finally:
        for proc in reversed(processes):
            stop(proc)


def test_the_gateways_view_credits_only_blocks_the_pool_holds(pool, pool_client):
    client = pool_client(pool.kv_store)
    namespace, hashes = "ns", [11, 12, 13, 14]
    assert client.put_batch([block_key(namespace, h) for h in hashes[:3]], [b"x" * 1024] * 3) == 0

    async def view_run():
        view = MooncakeView(pool.kv_store, refresh_s=0.05, credit_s=0.5)
        try:

            async def credited(expected):
                deadline = time.monotonic() + HANG_GUARD_S
                while (tiers := view.stored_tiers(namespace, hashes)) != expected:
                    assert time.monotonic() < deadline, f"view credits {tiers}, not {expected}"
                    await asyncio.sleep(0.02)

            assert view.stored_tiers(namespace, hashes) == []  # nothing known before it asks
            await credited(["dram"] * 3)  # the stored prefix, not the block after the gap
            client.remove(block_key(namespace, hashes[1]), True)
            await credited(["dram"])  # gone from the pool: no credit from it on
        finally:
            await view.close()

    asyncio.run(view_run())


def test_a_paused_store_node_costs_a_request_no_more_than_its_deadline(
    chat_checkpoint, pool_client
):
    """A read touching a SIGSTOPped node blocks Mooncake's thread for its transfer timeout
    (20-60 s, past the HTTP guard); the worker's deadline turns it into a miss."""
    model = str(chat_checkpoint)
    stack = start_stack(model, worker_args=WORKER_ARGS, mooncake=(2, NODE_BYTES, 1))
    paused = stack.mooncake_nodes
    try:
        cold = complete(stack.openai_address, PROMPT)
        keys, pool = written_through(stack, pool_client)

        replace_worker(stack, model)
        for node in paused:
            node.send_signal(signal.SIGSTOP)
        again = complete(stack.openai_address, PROMPT)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["choices"][0]["text"] == cold["choices"][0]["text"]
        assert_no_block_held(stack)
    finally:
        for node in paused:
            node.send_signal(signal.SIGCONT)
        stack.stop()


def test_the_master_killed_and_restarted_costs_no_request_and_caching_resumes(
    chat_checkpoint, pool_client
):
    """A restarted master holds nothing (Mooncake 0.3.13 keeps no metadata without HA); its
    nodes mount their segments again and the workers' clients carry on."""
    model = str(chat_checkpoint)
    stack = start_stack(model, worker_args=WORKER_ARGS, mooncake=(2, NODE_BYTES, 1))
    try:
        [master_proc] = [p for p in stack.processes if "mooncake_master" in p.args[0]]
        master_proc.kill()
        master_proc.wait()
        cold = complete(stack.openai_address, PROMPT)  # computed: the pool has no master
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        restarted, _ = start_master(stack.mooncake_master)
        stack.processes.insert(0, restarted)
        keys, pool = prompt_keys(stack), pool_client(stack.mooncake_master.kv_store)

        def stored_again():  # each request writes through what the pool lacks
            complete(stack.openai_address, PROMPT)
            return set(pool.batch_is_exist(keys)) == {1}

        wait_until(stored_again, "the write-through to land in the restarted pool")
        assert_a_new_worker_is_served_from_the_pool(stack, model, cold)
        assert_no_block_held(stack)
    finally:
        stack.stop()


def test_a_prefix_pushed_out_of_the_pools_dram_is_served_from_a_nodes_disk(
    chat_checkpoint, pool_client
):
    """Mooncake's disk tier, as make run starts it: the master writes the blocks it evicts
    from a node's DRAM to that node's folder first (`LOCAL_DISK` replicas), and a fresh worker
    reads them from there, named `mooncake_disk`, with the same greedy output."""
    model = str(chat_checkpoint)
    stack = start_stack(
        model,
        worker_args=WORKER_ARGS,
        mooncake=(2, DISK_TEST_NODE_BYTES, 1),
        mooncake_disk_bytes=DISK_TEST_DISK_BYTES,
    )
    try:
        cold = complete(stack.openai_address, PROMPT)
        keys, pool = written_through(stack, pool_client)

        def fill_dram() -> None:  # objects of the test's own; refused while DRAM is full
            fillers = [f"filler/{uuid.uuid4().hex}" for _ in range(32)]
            pool.put_batch(fillers, [b"x" * FILLER_BYTES] * len(fillers))
            time.sleep(0.5)

        def written() -> set[str]:  # the keys in the nodes' bucket metadata files
            found = set()
            for meta in glob.glob(os.path.join(stack.tmp.name, "mooncake-node*", "*.meta")):
                with open(meta, "rb") as f:
                    data = f.read()
                found.update(key for key in keys if key.encode() in data)
            return found

        def in_dram() -> list[str]:  # asking grants a read lease: DRAM kept 10 s more
            replicas = pool.batch_get_replica_desc(keys)
            return [k for k in keys if any(r.is_memory_replica() for r in replicas.get(k, ()))]

        # The master evicts the oldest blocks (their 10 s read leases past) once DRAM is 80%
        # full; a node first writes them to its disk, in buckets of 64, and only then does
        # their DRAM go. Existence queries grant leases too, so the test looks at the files
        # until the blocks are written, then asks the master at most every 12 s.
        deadline = time.monotonic() + 6 * HANG_GUARD_S
        while written() != set(keys):
            assert time.monotonic() < deadline, f"{len(written())} of {len(keys)} blocks on disk"
            fill_dram()
        asked = time.monotonic()
        while remaining := in_dram():
            while time.monotonic() < asked + LEASE_S + 2:
                assert time.monotonic() < deadline, f"{len(remaining)} blocks still in DRAM"
                fill_dram()
            asked = time.monotonic()

        replace_worker(stack, model)
        warm = complete(stack.openai_address, PROMPT)
        assert by_tier(warm) == {
            "local": 0,
            "store_dram": 0,
            "store_disk": 0,
            "mooncake_dram": 0,
            "mooncake_disk": NUM_BLOCKS * BLOCK,
        }
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert_no_block_held(stack)
    finally:
        stack.stop()


OFFLINE_POOL = """
from deploy.mooncake import start_master, start_node
from deploy.processes import stop
from services.kvcache.mooncake_pool import connect
master_proc, master = start_master()
node, _ = start_node(master, 16 << 20)
client = connect(master.kv_store, master.host)
try:
    assert client.put("offline/block", b"kv" * 1000) == 0
    assert client.get("offline/block") == b"kv" * 1000
finally:
    client.close()
    stop(node)
    stop(master_proc)
print("served")
"""


def test_a_pool_on_loopback_serves_with_the_network_cut():
    """Mooncake serves its transfers on a LAN address unless told otherwise, and finds none on a
    machine without a network: a pool on loopback must still store and serve."""
    prefix = cut_network()
    if not prefix:
        pytest.skip("this machine cannot cut a child's network (unshare -rn)")
    done = subprocess.run(
        [*prefix, sys.executable, "-c", OFFLINE_POOL],
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.strip().endswith("served"), done.stderr[-2000:]
