"""What the KV cache store holds, for the routing cost (`--kv-store HOST:PORT`).

The gateway follows the store's `Events` stream for its model's namespace (the one its
workers report) and keeps every stored block's tier in memory, so routing reads the store's
prefix of a prompt locally, without a call per request. The first batch is a snapshot, which
replaces what the view held; later batches must follow on without a gap in their numbers.
A gap, a new incarnation (the store restarted) or a broken stream empties the view at once
(routing goes on as without a store: a stale view would credit blocks that are gone), and it
resubscribes every `retry_s`. Memory: one dict entry per stored block (about 100 bytes).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import grpc

from tandem.v1 import kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger(__name__)


class ResyncNeeded(Exception):
    pass


class StoreView:
    def __init__(self, address: str, retry_s: float = 1.0):
        self.address = address
        self.retry_s = retry_s
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.namespace = ""
        self.tiers: dict[int, str] = {}  # block hash -> dram | disk
        self._task: Optional[asyncio.Task] = None

    def stored_tiers(self, namespace: str, block_hashes: list[int]) -> list[str]:
        """`dram` or `disk` for each block of the longest stored prefix; [] while unknown."""
        if namespace != self.namespace:
            self._follow(namespace)
        tiers = []
        for block_hash in block_hashes:
            tier = self.tiers.get(block_hash)
            if tier is None:
                break
            tiers.append(tier)
        return tiers

    def _follow(self, namespace: str) -> None:
        if self._task is not None:
            self._task.cancel()
        self.namespace, self.tiers = namespace, {}
        self._task = asyncio.create_task(self._run(), name="kv-store-events") if namespace else None

    async def _run(self) -> None:
        failing = False
        while True:
            try:
                await self._stream()
            except (grpc.aio.AioRpcError, ResyncNeeded) as exc:
                if not failing:
                    log.warning("KV store events from %s: %s; routing without the store until it answers", self.address,
                                exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else exc)
                failing = True
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the view die: empty it and try again
                log.exception("KV store events from %s failed", self.address)
            self.tiers = {}
            await asyncio.sleep(self.retry_s)

    async def _stream(self) -> None:
        call = self.stub.Events(kvcache_pb2.EventsRequest(namespace=self.namespace))
        try:
            expected, incarnation, in_snapshot = None, None, False
            async for batch in call:
                if batch.snapshot:
                    if not in_snapshot:
                        self.tiers, incarnation, expected = {}, batch.incarnation, batch.first_seq
                    in_snapshot = batch.more
                    if not in_snapshot:
                        log.info("following the KV store's contents at %s (%d blocks)", self.address,
                                 len(self.tiers) + len(batch.dram) + len(batch.disk))
                elif in_snapshot or batch.first_seq != expected or batch.incarnation != incarnation:
                    raise ResyncNeeded(f"event {batch.first_seq} where {expected} was due")
                else:
                    expected += len(batch.dram) + len(batch.disk) + len(batch.gone)
                self.tiers.update(dict.fromkeys(batch.dram, "dram"))
                self.tiers.update(dict.fromkeys(batch.disk, "disk"))
                for block_hash in batch.gone:
                    self.tiers.pop(block_hash, None)
            raise ResyncNeeded("the stream ended")
        finally:
            call.cancel()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.channel.close()
