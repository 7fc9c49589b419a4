"""Mooncake Store as the cluster KV tier, with real processes: a mooncake_master and two store
nodes. A prompt computed by one worker is served from the pool to a worker with an empty cache
(cached_tokens = its full blocks, the same greedy output), its blocks stored under tandem's
namespaced chained block hashes; a store node killed under load costs no request, and with two
replicas the blocks it held are served from the other node; no worker KV block stays held."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deploy.stack import start_stack
from engine.block_hash import hash_blocks
from services.worker.mooncake_store import parse_address
from tandem.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.test_kv_store import (
    BLOCK,
    PROMPT,
    WORKER_ARGS,
    assert_no_block_held,
    by_tier,
    complete,
    wait_until,
)

NODE_BYTES = 64 << 20
NUM_BLOCKS = (len(PROMPT) - 1) // BLOCK  # the prompt's full blocks a worker loads


@pytest.fixture
def pool_client():
    """Connects a Mooncake client of the test's own (no memory in the pool) to a pool."""
    clients = []

    def connect(kv_store: str):
        from mooncake.store import MooncakeDistributedStore

        master, metadata = parse_address(kv_store)
        client = MooncakeDistributedStore()
        code = client.setup("127.0.0.1", metadata + "/metadata", 0, 16 << 20, "tcp", "", master)
        assert code == 0
        clients.append(client)
        return client

    try:
        yield connect
    finally:
        for client in clients:
            client.close()


def worker_health(address: str) -> worker_pb2.HealthResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Health(worker_pb2.HealthRequest(), timeout=5)


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
        [worker] = stack.workers["both"]
        namespace = worker_health(worker).kv_store_namespace
        keys = [f"{namespace}/{h:x}" for h in hash_blocks(PROMPT, BLOCK)[:NUM_BLOCKS]]
        pool = pool_client(stack.mooncake_master.kv_store)
        wait_until(lambda: set(pool.batch_is_exist(keys)) == {1}, "the write-through to land")

        replace_worker(stack, model)
        warm = complete(stack.openai_address, PROMPT)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == NUM_BLOCKS * BLOCK
        assert by_tier(warm) == {"local": 0, "store_dram": NUM_BLOCKS * BLOCK, "store_disk": 0}
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
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
        [worker] = stack.workers["both"]
        namespace = worker_health(worker).kv_store_namespace
        keys = [f"{namespace}/{h:x}" for h in hash_blocks(PROMPT, BLOCK)[:NUM_BLOCKS]]
        pool = pool_client(stack.mooncake_master.kv_store)
        wait_until(lambda: set(pool.batch_is_exist(keys)) == {1}, "the write-through to land")
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
        replace_worker(stack, model)
        warm = complete(stack.openai_address, PROMPT)
        assert by_tier(warm) == {"local": 0, "store_dram": NUM_BLOCKS * BLOCK, "store_disk": 0}
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert_no_block_held(stack)
    finally:
        stack.stop()
