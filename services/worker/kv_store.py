"""A worker's link to the KV cache store (services/kvcache), `--kv-store HOST:PORT`.

- **Load before admission.** When the store holds a longer prefix of a prompt than this
  worker's own cache, the missing blocks are pushed here (into blocks reserved by the worker's
  KV inbox, as a prefill worker's push is) and registered in the prefix cache by the same
  engine command that adds the request (nothing can evict them in between); the engine then
  prefills only the rest, and reports the loaded tokens as cached. The request waits in its
  own handler while this happens: nothing else waits. One `Get` does it (the store pushes
  the longest prefix it holds); the local cache is read off the engine thread, as a hint.
- **Write-through.** Once a prompt is computed, it is queued (write_queue.py: at most
  `MAX_PENDING_WRITES`, the oldest shed when full) for `NUM_WRITERS` writer tasks, which copy
  out its full blocks the store lacks and push them to it. A request never waits for it.
- **Never a failure.** Every store call has a deadline (`timeout_s`); any failure means the
  worker recomputes. Loads and writes back off apart (store_backoff.py): a failure skips that
  path only, for a fraction of a second growing with failures in a row up to 10 s, so a dead,
  paused or slow store costs at most one deadline per back-off period, and a store that is
  slow to take writes still serves loads.

Blocks are stored under a namespace of the model's identity (its config and a sample of its
weight files' bytes), dtype, block size and layout: another model's blocks never hit.
"""

from __future__ import annotations

import asyncio
import glob
import hashlib
import logging
import os
import time
import uuid
from dataclasses import dataclass

import grpc
import torch

from engine.block_hash import hash_blocks, salt_root
from engine.requests import Reservation
from services.decode.kv_inbox import KVInbox
from services.kvcache.keys import namespace
from services.kvtransfer import Senders, TransferHeader
from services.worker import metrics
from services.worker.engine_loop import EngineLoop
from services.worker.store_backoff import Backoff
from services.worker.write_queue import WriteQueue
from tandem.v1 import kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger(__name__)
# A few prompts' worth: a store that keeps up drains it at once; one that does not sheds the
# oldest instead of holding KV copies for writes it will never take.
MAX_PENDING_WRITES = 32
NUM_WRITERS = 2  # one writes while the other asks the store what it lacks and copies blocks out
SAMPLE_BYTES = 1 << 16
TIERS = ("dram", "disk", "mooncake", "mooncake_disk")  # the worker proto's StoreTokens fields


def model_identity(folder: str) -> str:
    """Config plus each weight file's size and first and last 64 KiB: two checkpoints that
    differ in any of these never share blocks (reading whole weight files would cost seconds)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(os.path.join(folder, "config.json"), "rb") as f:
        digest.update(f.read())
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            f.seek(max(size - SAMPLE_BYTES, 0))
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


@dataclass
class Loaded:
    """Blocks the store pushed into reserved blocks of the pool: the request brings them to
    the engine (`engine.requests.FromStore`), which caches them just before queueing it."""

    reservation: Reservation
    block_hashes: list[int]
    tiers: list[str]  # each block's store tier: dram | disk (built-in), mooncake | mooncake_disk
    first_block: int  # the prompt's block they start at (the local cache held those before)
    block_size: int

    def store_tokens(self, num_cached_tokens: int) -> dict[str, int]:
        """Of the request's cached tokens, those loaded, by tier: the loaded blocks inside the
        cached range (a local block evicted before admission ends the range early)."""
        used = min(max(num_cached_tokens // self.block_size - self.first_block, 0), len(self.tiers))
        return {tier: self.tiers[:used].count(tier) * self.block_size for tier in TIERS}


class StoreConnector:
    def __init__(
        self,
        address: str,
        loop: EngineLoop,
        inbox: KVInbox,
        kv_address: str,
        model: str,
        timeout_s: float = 2.0,
    ):
        """`model`: the checkpoint's folder, whose identity names the namespace."""
        self.kv = loop.engine.kv
        self.loop, self.inbox, self.kv_address, self.timeout_s = loop, inbox, kv_address, timeout_s
        layout = self.kv.layout
        self.block_size = layout.block_size
        # [layers, 2, block_size, kv_heads, head_dim]: the whole model's, whatever the parallelism
        self.block_shape = list(layout.block_shape)
        self.dtype = layout.dtype_name
        self.namespace = namespace(
            model_identity(model), self.dtype, self.block_size, self.block_shape
        )
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.senders = Senders()
        self.store_kv_address: str | None = None
        self.loads = Backoff("load", "loading a prefix")
        self.writes = Backoff("store", "storing blocks")
        self.num_loaded_blocks = 0
        self.pending_writes: WriteQueue[tuple[list[int], str]] = WriteQueue(
            self._write, MAX_PENDING_WRITES, NUM_WRITERS, on_drop=self._shed
        )

    @staticmethod
    def _shed(write: tuple[list[int], str]) -> None:
        metrics.KV_STORE_WRITES_DROPPED.labels("queue_full").inc()

    async def load_prefix(
        self, request_id: str, prompt: list[int], cache_salt: str = ""
    ) -> Loaded | None:
        """Loads the stored blocks of the prompt's prefix this worker lacks into reserved blocks
        (one `Get`: the store pushes its longest stored prefix of them); None when there are none."""
        if not self.loads.available():
            return None
        started_at = time.monotonic()
        hashes = hash_blocks(prompt, self.block_size, salt_root(cache_salt))
        hashes = hashes[: (len(prompt) - 1) // self.block_size]
        # Read off the engine thread: a hint (a block evicted meanwhile is recomputed).
        local = self.kv.num_cached_blocks(hashes)
        if local == len(hashes):
            return None
        wanted = hashes[local:]
        transfer_id = f"store-{request_id}-{uuid.uuid4().hex[:8]}"
        try:
            got = await self.stub.Get(
                kvcache_pb2.GetRequest(
                    namespace=self.namespace,
                    block_hashes=wanted,
                    block_shape=self.block_shape,
                    dtype=self.dtype,
                    destination=self.kv_address,
                    request_id=transfer_id,
                    timeout_s=self.timeout_s,
                ),
                timeout=self.timeout_s,
            )
            if not got.num_blocks:
                self.loads.succeeded()
                return None
            transfer = await self.inbox.take(transfer_id, self.timeout_s)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            self.loads.failed(started_at, exc)
            return None
        self.loads.succeeded()
        self.num_loaded_blocks += got.num_blocks
        return Loaded(
            transfer.reservation, wanted[: got.num_blocks], list(got.tiers), local, self.block_size
        )

    def offer(self, prompt: list[int], cache_salt: str = "") -> None:
        """Write-through of the prompt's full blocks, in the background (queued, never waited on)."""
        if self.writes.available():
            self.pending_writes.put((prompt, cache_salt))
        else:
            metrics.KV_STORE_WRITES_DROPPED.labels("backoff").inc()

    async def _write(self, write: tuple[list[int], str]) -> None:
        prompt, cache_salt = write
        if not self.writes.available():  # it failed while this one was queued
            metrics.KV_STORE_WRITES_DROPPED.labels("backoff").inc()
            return
        started_at = time.monotonic()
        hashes = hash_blocks(prompt, self.block_size, salt_root(cache_salt))
        try:
            if self.store_kv_address is None:
                stats = await self.stub.Stats(kvcache_pb2.StatsRequest(), timeout=self.timeout_s)
                self.store_kv_address = stats.kv_address
            missing = list(
                (
                    await self.stub.Missing(
                        kvcache_pb2.LookupRequest(namespace=self.namespace, block_hashes=hashes),
                        timeout=self.timeout_s,
                    )
                ).block_hashes
            )
            if not missing:
                self.writes.succeeded()
                return
            found, data = await self.loop.acall(self.kv.read, missing)
            if not found:
                return
            payload = data.contiguous().view(torch.uint8).numpy().reshape(-1)
            header = TransferHeader(
                request_id=f"put-{uuid.uuid4().hex}",
                nbytes=payload.nbytes,
                deadline_s=self.timeout_s,
                shape=list(data.shape),
                dtype=self.dtype,
                block_hashes=found,
                namespace=self.namespace,
            )
            await asyncio.to_thread(
                self.senders.send,
                self.store_kv_address,
                header,
                lambda skip: payload,
                self.timeout_s,
            )
            self.writes.succeeded()
        except Exception as exc:  # a put is best effort: never an error for a request
            self.writes.failed(started_at, exc)
            self.store_kv_address = None  # a restarted store takes KV on a new port: ask again

    async def close(self) -> None:
        await self.pending_writes.close()
        self.senders.close()
        await self.channel.close()
