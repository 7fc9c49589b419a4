"""A worker's StoreConnector against a fake store (its gRPC stub replaced): loads and writes
back off apart, and write-throughs the store cannot take are shed, oldest first, and counted,
never waited on."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from services.worker import metrics
from services.worker.kv_store import MAX_PENDING_WRITES, NUM_WRITERS, StoreConnector
from tandem.v1 import kvcache_pb2

BLOCK = 16
PROMPT = list(range(3, 3 + 4 * BLOCK + 1))  # four full blocks


class FakeStore:
    """The store's KVCache stub: holds nothing; each call can fail or hang."""

    def __init__(self):
        self.num_gets = self.num_stats = 0
        self.get_fails = self.stats_fails = False
        self.stats_hang = asyncio.Event()  # set: Stats answers; clear and stats_hangs: waits

    async def Get(self, request, timeout):
        self.num_gets += 1
        if self.get_fails:
            raise TimeoutError("the store did not push in time")
        return kvcache_pb2.GetResponse()

    async def Stats(self, request, timeout):
        self.num_stats += 1
        if self.stats_fails:
            raise TimeoutError("the store did not answer in time")
        await self.stats_hang.wait()
        return kvcache_pb2.StatsResponse(kv_address="tcp://127.0.0.1:9")

    async def Missing(self, request, timeout):
        return kvcache_pb2.MissingResponse()  # the store has them all: nothing to send


def fake_loop() -> SimpleNamespace:
    layout = SimpleNamespace(
        block_size=BLOCK, block_shape=(2, 2, BLOCK, 1, 4), dtype_name="float32"
    )
    kv = SimpleNamespace(layout=layout, num_cached_blocks=lambda hashes: 0)
    return SimpleNamespace(engine=SimpleNamespace(kv=kv))


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(tmp_path)


def connected(model: str) -> tuple[StoreConnector, FakeStore]:
    connector = StoreConnector("127.0.0.1:9", fake_loop(), None, "tcp://127.0.0.1:8", model)
    connector.stub = FakeStore()
    return connector, connector.stub


def dropped(reason: str) -> float:
    return (
        metrics.REGISTRY.get_sample_value(
            "tandem:kv_store_writes_dropped_total", {"reason": reason}
        )
        or 0.0
    )


def test_failing_writes_leave_loads_alone(model):
    async def run():
        connector, store = connected(model)
        store.stats_fails = True
        connector.offer(PROMPT)
        await connector.pending_writes.join()
        assert not connector.writes.available()
        before = dropped("backoff")
        connector.offer(PROMPT)  # skipped while writes back off: counted, not queued
        assert dropped("backoff") == before + 1 and connector.pending_writes.num_pending == 0
        assert await connector.load_prefix("r1", PROMPT) is None
        assert store.num_gets == 1 and connector.loads.available()
        await connector.close()

    asyncio.run(run())


def test_a_failing_load_leaves_writes_alone(model):
    async def run():
        connector, store = connected(model)
        store.get_fails, store.stats_hang = True, asyncio.Event()
        store.stats_hang.set()
        assert await connector.load_prefix("r1", PROMPT) is None
        assert not connector.loads.available()
        assert await connector.load_prefix("r2", PROMPT) is None  # skipped: no call
        assert store.num_gets == 1
        connector.offer(PROMPT)
        await connector.pending_writes.join()
        assert store.num_stats == 1 and connector.writes.available()
        await connector.close()

    asyncio.run(run())


def test_writes_a_slow_store_cannot_take_are_shed_oldest_first_and_counted(model):
    async def run():
        connector, store = connected(model)  # Stats hangs: every writer waits on the store
        before = dropped("queue_full")
        num_offered = MAX_PENDING_WRITES + NUM_WRITERS + 5
        for i in range(num_offered):
            connector.offer(PROMPT[:-1] + [i])
            await asyncio.sleep(0)
        assert dropped("queue_full") == before + 5
        assert connector.pending_writes.num_pending == MAX_PENDING_WRITES
        await connector.close()

    asyncio.run(run())


def test_a_failed_write_asks_the_store_where_it_takes_kv_again(model, monkeypatch):
    """A store that restarted is on its gRPC port again, but takes KV on a new one."""

    async def run():
        connector, store = connected(model)
        store.stats_hang.set()
        sent_to = []

        def send(address, header, payload, timeout):
            sent_to.append(address)
            raise ConnectionError("nobody listens there any more")

        async def on_engine_thread(fn, *args):
            return fn(*args)

        async def missing(request, timeout):
            return kvcache_pb2.MissingResponse(block_hashes=request.block_hashes)

        store.Missing = missing
        connector.kv.read = lambda blocks: (blocks, torch.zeros(len(blocks), 2, 2, BLOCK, 1, 4))
        connector.loop.acall = on_engine_thread
        monkeypatch.setattr(connector.senders, "send", send)
        connector.offer(PROMPT)
        await connector.pending_writes.join()
        assert sent_to == ["tcp://127.0.0.1:9"] and connector.store_kv_address is None
        await connector.close()

    asyncio.run(run())
