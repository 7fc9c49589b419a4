"""The store's event stream: a subscriber that applies the snapshot and then every batch holds
exactly what the store holds (puts, spills to disk, promotions, drops), only for its own
namespace; and the gateway's view of it, over real gRPC, credits stored blocks, follows
changes, and empties itself when the store goes away."""

from __future__ import annotations

import asyncio

import grpc

from services.gateway.routing.store_view import StoreView
from services.kvcache.disk import DiskTier
from services.kvcache.keys import namespace
from services.kvcache.servicer import KVCacheServicer
from services.kvcache.store import BlockStore
from services.kvtransfer import Senders
from tandem.v1 import kvcache_pb2_grpc

NS = namespace("tandem-demo@abc", "float32", 16, [4, 2, 16, 2, 32])
OTHER = namespace("another-model@def", "float32", 16, [4, 2, 16, 2, 32])
BLOCK = 1000


def block(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(BLOCK))


def apply(view: dict, batch) -> None:
    for block_hash, tier in batch.events:
        if tier:
            view[block_hash] = tier
        else:
            view.pop(block_hash, None)


def test_snapshot_plus_events_equal_what_the_store_holds(tmp_path):
    async def scenario():
        store = BlockStore(dram_bytes=3 * BLOCK, disk=DiskTier(str(tmp_path), 100 * BLOCK))
        servicer = KVCacheServicer(store, Senders(), 1.0)
        servicer.events.event_loop = asyncio.get_running_loop()
        with servicer.lock:
            store.put((NS, 0), block(0))  # before anyone follows: in the snapshot
        queue, snapshot, _ = servicer.events.subscribe(NS)
        assert snapshot.snapshot and snapshot.events == [(0, "dram")]
        other_queue, _, _ = servicer.events.subscribe(OTHER)
        view = dict(snapshot.events)
        with servicer.lock:
            for i in range(1, 3):
                store.put((NS, i), block(i))
            # used twice: spilled to disk later
            store.release(store.acquire(NS, [0, 1], lease_s=10).id)
            for i in range(3, 6):
                store.put((NS, i), block(i))  # evicts 0, 1 (to disk) and 2 (dropped)
            store.put((OTHER, 7), block(7))
        store.disk.flush()
        with servicer.lock:
            store.release(store.acquire(NS, [0], lease_s=10).id)  # promoted from disk
        store.disk.flush()
        await asyncio.sleep(0.05)
        seq = snapshot.first_seq
        while not queue.empty():
            batch = queue.get_nowait()
            assert batch.first_seq == seq  # numbered without gaps
            seq += len(batch.events)
            apply(view, batch)
        # 7 (another model) evicted 3, 0 evicted 4
        assert view == dict(store.held(NS)) == {0: "dram", 1: "disk", 5: "dram"}
        other = [
            e
            for b in [other_queue.get_nowait() for _ in range(other_queue.qsize())]
            for e in b.events
        ]
        assert other == [(7, "dram")]  # each namespace sees only its own blocks

    asyncio.run(scenario())


def test_the_gateway_view_follows_the_store_and_forgets_it_when_it_dies():
    async def scenario():
        store = BlockStore(dram_bytes=10 * BLOCK)
        servicer = KVCacheServicer(store, Senders(), 1.0)
        servicer.events.event_loop = asyncio.get_running_loop()
        server = grpc.aio.server()
        kvcache_pb2_grpc.add_KVCacheServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        with servicer.lock:
            store.put((NS, 10), block(10))
            store.put((OTHER, 11), block(11))
        view = StoreView(f"127.0.0.1:{port}", retry_s=0.1)

        async def until(condition):
            for _ in range(100):
                if condition():
                    return
                await asyncio.sleep(0.02)
            raise AssertionError("the view did not catch up")

        try:
            assert view.stored_tiers(NS, [10, 12]) == []  # not known yet: it starts following
            await until(lambda: view.stored_tiers(NS, [10, 12]) == ["dram"])
            with servicer.lock:
                store.put((NS, 12), block(12))
            await until(lambda: view.stored_tiers(NS, [10, 12, 13]) == ["dram", "dram"])
            assert view.stored_tiers(NS, [11]) == []  # another model's block
            await server.stop(grace=0)
            await until(lambda: view.stored_tiers(NS, [10]) == [])  # no stale credit
        finally:
            await server.stop(grace=0)
            await view.close()

    asyncio.run(scenario())
