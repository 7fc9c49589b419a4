"""The KVCache gRPC service over a BlockStore, and the receiving end of writers' puts.

A block is stored as one buffer, its layers one after another ([layers, 2, block_size,
kv_heads, head_dim]); transfers carry [layers, blocks, ...] (the engine's layout), so a put
lands in one buffer of that layout and is cut into blocks when it completes, and a get's
payload is the blocks' bytes with the layer and block axes swapped. The store is shared by
the event loop (Lookup, Get, Stats) and the transport's threads (puts), under one lock.
`Events` streams a namespace's holdings to gateways (events.py).
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import numpy as np

from services import faults
from services.event_log import Unsubscribed, batches_after
from services.kvcache.events import StoreEvents
from services.kvcache.store import BlockStore
from services.kvtransfer import Accepted, Senders, TransferError, TransferHeader, TransferRefused
from tandem.v1 import kvcache_pb2, kvcache_pb2_grpc

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
SNAPSHOT_BATCH = 65_536  # blocks per message of a snapshot (gRPC's default limit is 4 MiB)


class KVCacheServicer(kvcache_pb2_grpc.KVCacheServicer):
    def __init__(self, store: BlockStore, senders: Senders, transfer_timeout_s: float):
        self.store = store
        self.senders = senders
        self.transfer_timeout_s = transfer_timeout_s
        self.lock = threading.Lock()
        self.kv_address = ""
        self._puts: dict[str, list] = {}
        self.events = StoreEvents(self._locked(store.tier_of), self._locked(store.held))
        store.on_change = self.events.changed

    def _locked(self, fn):
        def call(*args):
            with self.lock:
                return fn(*args)

        return call

    # Control.

    async def Lookup(self, request, context):
        with self.lock:
            tiers = self.store.lookup(request.namespace, list(request.block_hashes))
        return kvcache_pb2.LookupResponse(tiers=tiers)

    async def Missing(self, request, context):
        await asyncio.sleep(faults.FAULTS.get("store_delay_s", 0))
        with self.lock:
            missing = [
                h for h in request.block_hashes if not self.store.lookup(request.namespace, [h])
            ]
        return kvcache_pb2.MissingResponse(block_hashes=missing)

    async def Get(self, request, context):
        await asyncio.sleep(faults.FAULTS.get("store_delay_s", 0))
        if not request.destination or not request.request_id or len(request.block_shape) != 5:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "destination, request_id and a 5-dimensional block_shape are required",
            )
        timeout_s = min(request.timeout_s or self.transfer_timeout_s, self.transfer_timeout_s)
        with self.lock:
            lease = self.store.acquire(
                request.namespace, list(request.block_hashes), lease_s=timeout_s + 5
            )
        try:
            if not lease.blocks:
                return kvcache_pb2.GetResponse()
            layers, n = request.block_shape[0], len(lease.blocks)
            # Each block is [layers, per-layer bytes]; the payload is [layers, blocks, ...], the engine's layout.
            data = np.empty((layers, n, len(lease.blocks[0]) // layers), np.uint8)
            for i, block in enumerate(lease.blocks):
                data[:, i] = np.frombuffer(block, np.uint8).reshape(layers, -1)
            header = TransferHeader(
                request_id=request.request_id,
                nbytes=data.nbytes,
                deadline_s=timeout_s,
                shape=[layers, n, *request.block_shape[1:]],
                dtype=request.dtype,
                block_hashes=[k[1] for k in lease.keys],
                namespace=request.namespace,
            )
            try:
                nbytes = await asyncio.to_thread(
                    self.senders.send,
                    request.destination,
                    header,
                    lambda skip: data[:, skip:].reshape(-1),
                    timeout_s,
                )
            except TransferRefused as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            except TransferError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            return kvcache_pb2.GetResponse(num_blocks=n, tiers=lease.tiers, num_bytes=nbytes)
        finally:
            with self.lock:
                self.store.release(lease.id)

    async def Stats(self, request, context):
        with self.lock:
            stats, dram, disk = self.store.stats, self.store.dram, self.store.disk
            return kvcache_pb2.StatsResponse(
                kv_address=self.kv_address,
                dram=kvcache_pb2.TierStats(
                    bytes=dram.nbytes,
                    blocks=len(dram),
                    hits=stats.dram.hits,
                    misses=stats.dram.misses,
                    evictions=stats.dram.evictions,
                ),
                disk=kvcache_pb2.TierStats(
                    bytes=disk.nbytes if disk else 0,
                    blocks=len(disk) if disk else 0,
                    hits=stats.disk.hits,
                    misses=stats.disk.misses,
                    evictions=disk.num_evictions if disk else 0,
                ),
                num_puts=stats.num_puts,
                num_duplicate_puts=stats.num_duplicate_puts,
                num_corrupt_files=disk.num_corrupt if disk else 0,
                num_dropped_disk_writes=disk.num_dropped_writes if disk else 0,
                disk_full=bool(disk and disk.disk_full),
            )

    async def Events(self, request, context):
        if not request.namespace:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "namespace is required")
        queue, snapshot, incarnation = self.events.subscribe(request.namespace)
        try:
            blocks = snapshot.events
            for start in range(0, max(len(blocks), 1), SNAPSHOT_BATCH):
                part = blocks[start : start + SNAPSHOT_BATCH]
                yield event_batch(
                    incarnation,
                    snapshot.first_seq,
                    part,
                    snapshot=True,
                    more=start + SNAPSHOT_BATCH < len(blocks),
                )
            async for batch in batches_after(queue, snapshot):
                yield event_batch(incarnation, batch.first_seq, batch.events)
        except Unsubscribed:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "store events subscriber fell behind; resubscribe",
            )
        finally:
            self.events.unsubscribe(request.namespace, queue)

    # Puts, from the transport's threads.

    def on_header(self, header: TransferHeader) -> Accepted:
        shape = header.shape
        if not header.namespace or len(shape) != 6 or len(header.block_hashes) != shape[1]:
            raise TransferRefused(
                "a store put names its namespace and one hash per block of shape [layers, blocks, ...]"
            )
        if header.dtype not in ITEMSIZE:
            raise TransferRefused(f"unknown dtype {header.dtype!r}")
        layers, num_blocks = shape[0], shape[1]
        per_layer = int(np.prod(shape[2:])) * ITEMSIZE[header.dtype]
        if header.nbytes != layers * num_blocks * per_layer:
            raise TransferRefused(
                f"a put of {header.nbytes} bytes; shape {shape} makes {layers * num_blocks * per_layer}"
            )
        with self.lock:
            if header.request_id in self._puts:
                raise TransferRefused(f"a put named {header.request_id!r} is already arriving")
            pendings = [self.store.begin_put((header.namespace, h)) for h in header.block_hashes]
            # One segment for the whole payload (a message-based transport sends one message per
            # segment); blocks a concurrent writer is storing arrive too and are dropped.
            payload = np.empty((layers, num_blocks, per_layer), np.uint8)
            self._puts[header.request_id] = (pendings, payload)
        return Accepted([payload.reshape(-1)])

    def on_done(self, header: TransferHeader, ok: bool) -> None:
        with self.lock:
            pendings, payload = self._puts.pop(header.request_id, ((), None))
            for i, pending in enumerate(pendings):
                if pending is None:
                    continue
                if ok:
                    # one block: its layers in turn
                    self.store.commit_put(pending, payload[:, i].tobytes())
                else:
                    self.store.abort_put(pending)


def event_batch(
    incarnation: str,
    first_seq: int,
    blocks: list[tuple[int, str]],
    snapshot: bool = False,
    more: bool = False,
) -> kvcache_pb2.EventBatch:
    by_tier: dict[str, list[int]] = {"dram": [], "disk": [], "": []}
    for block_hash, tier in blocks:
        by_tier[tier].append(block_hash)
    return kvcache_pb2.EventBatch(
        incarnation=incarnation,
        first_seq=first_seq,
        snapshot=snapshot,
        more=more,
        dram=by_tier["dram"],
        disk=by_tier["disk"],
        gone=by_tier[""],
    )
