"""What the KV cache store holds, for the routing cost (`--kv-store HOST:PORT`).

The gateway follows the store's `Events` stream for its model's namespace (the one its
workers report) and keeps every stored block's tier in memory, so routing reads the store's
prefix of a prompt locally, without a call per request. The first batch is a snapshot, which
replaces what the view held; later batches must follow on without a gap in their numbers.
A gap, a new incarnation (the store restarted) or a broken stream empties the view at once
(routing goes on as without a store: a stale view would credit blocks that are gone), and it
resubscribes every `retry_s` (event_feed.py). Memory: one dict entry per stored block (about 100 bytes).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.gateway.routing.event_feed import Numbering, follow
from tandem.v1 import kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger(__name__)


class StoreView:
    def __init__(self, address: str, retry_s: float = 1.0):
        self.address = address
        self.retry_s = retry_s
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.namespace = ""
        self.tiers: dict[int, str] = {}  # block hash -> dram | disk
        self._task: asyncio.Task | None = None

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
        if namespace:
            self._task = asyncio.create_task(
                follow(
                    f"KV store events from {self.address}", self._stream, self._forget, self.retry_s
                ),
                name="kv-store-events",
            )

    def _forget(self) -> None:
        self.tiers = {}

    async def _stream(self, numbering: Numbering) -> None:
        call = self.stub.Events(kvcache_pb2.EventsRequest(namespace=self.namespace))
        try:
            async for batch in call:
                num_events = len(batch.dram) + len(batch.disk) + len(batch.gone)
                if numbering.check(
                    batch.incarnation, batch.first_seq, batch.snapshot, num_events, batch.more
                ):
                    self.tiers = {}
                if batch.snapshot and not batch.more:
                    log.info(
                        "following the KV store's contents at %s (%d blocks)",
                        self.address,
                        len(self.tiers) + len(batch.dram) + len(batch.disk),
                    )
                self.tiers.update(dict.fromkeys(batch.dram, "dram"))
                self.tiers.update(dict.fromkeys(batch.disk, "disk"))
                for block_hash in batch.gone:
                    self.tiers.pop(block_hash, None)
        finally:
            call.cancel()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.channel.close()
