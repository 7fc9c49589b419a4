"""A worker's link to a Mooncake Store pool (`--kv-store mooncake://MASTER?metadata=URL`,
`KV_STORE=mooncake`): the same contract as `kv_store.StoreConnector`, on Mooncake.

- **Keys.** One Mooncake object a block: `<namespace>/<block hash, hex>`, the block's bytes in
  the engine's layout ([layers, entries, block_size, kv_heads, head_dim], `KVLayout.block_shape`):
  the namespaced chained hashes routing and the built-in store use, so two models never meet.
- **Load before admission.** `batch_is_exist` finds the longest stored run of the blocks this
  worker lacks; `batch_get_into` reads them into a registered buffer of this call's own; then,
  on the engine thread, one command reserves the blocks and copies the bytes in. A block that
  fails to arrive (its node died: TRANSFER_FAIL; forgotten: OBJECT_NOT_FOUND) ends the run: a
  miss, never an error.
- **Tiers.** Before the read, `batch_get_replica_desc` names each block's replicas: a block with
  a memory replica is read from its node's DRAM (`mooncake`), one with only a `LOCAL_DISK`
  replica from its node's disk, through that node's offload RPC server (`mooncake_disk`;
  services/kvcache/mooncake_pool.py). Mooncake's read reports no tier of its own; the tier is
  exact because the query grants each block a read lease (10 s, past the deadline) and the
  master evicts no leased block from DRAM, and promotion from disk back to DRAM is off.
- **Write-through.** The prompt's full blocks Mooncake lacks are copied out of the pool into a
  registered buffer and put with `batch_put_from` (`replica_num` copies on distinct nodes), in
  a task of their own. A block another worker put first (OBJECT_ALREADY_EXISTS) is no failure;
  a block refused because every node's DRAM is full (NO_AVAILABLE_HANDLE: with disk tiers,
  DRAM the master chose to evict stays until its node has written it to disk) is not stored,
  counted as a `full` store failure, and never backs the worker off the pool.
- **Deadlines and held blocks.** Mooncake's calls block their thread (a paused node holds a
  read for its transfer timeout, 20-60 s). Every call runs on this connector's threads under
  `timeout_s`; a call that outlives it is abandoned, and its buffer is freed when it returns.
  That is why the bytes go through a buffer of the call's own rather than straight into the
  reserved blocks: blocks are reserved only once their bytes are here, so no KV block waits on
  Mooncake, and an abandoned read can never write into blocks given back and reused. Loads and
  writes back off apart, as the built-in store's do (services/worker/store_backoff.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.block_hash import hash_blocks, salt_root
from engine.requests import Reservation
from services.kvcache.keys import namespace
from services.kvcache.mooncake_pool import (
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    block_key,
    connect,
)
from services.worker import metrics
from services.worker.engine_loop import EngineLoop
from services.worker.kv_store import Loaded, model_identity
from services.worker.store_backoff import Backoff

log = logging.getLogger(__name__)
NUM_THREADS = 4


class MooncakeConnector:
    def __init__(
        self,
        address: str,
        loop: EngineLoop,
        model: str,
        host: str = "127.0.0.1",
        timeout_s: float = 2.0,
        replica_num: int = 1,
    ):
        self.kv = loop.engine.kv
        self.loop, self.timeout_s = loop, timeout_s
        layout = self.kv.layout
        self.block_size = layout.block_size
        self.block_shape = list(layout.block_shape)
        self.dtype = layout.dtype
        self.bytes_per_block = layout.bytes_per_block
        self.namespace = namespace(
            model_identity(model), layout.dtype_name, self.block_size, self.block_shape
        )
        # Contributes no memory (segment 0): the store nodes hold the blocks. Master RPCs give
        # up within the deadline rather than Mooncake's 30 s.
        self.store = connect(address, host, 0, timeout_s)
        from mooncake.store import ReplicateConfig

        self.put_config = ReplicateConfig()
        self.put_config.replica_num = replica_num
        self.threads = ThreadPoolExecutor(NUM_THREADS, thread_name_prefix="mooncake")
        self.loads = Backoff("load", "loading a prefix from Mooncake")
        self.writes = Backoff("store", "storing blocks in Mooncake")
        self.num_loaded_blocks = 0
        self._offers: set[asyncio.Task] = set()

    def key(self, block_hash: int) -> str:
        return block_key(self.namespace, block_hash)

    async def _call(self, fn, *args):
        """`fn(*args)` on a Mooncake thread, within the deadline (TimeoutError past it)."""
        future = asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)
        return await asyncio.wait_for(future, self.timeout_s)

    def _num_stored(self, block_hashes: list[int]) -> int:
        exists = self.store.batch_is_exist([self.key(h) for h in block_hashes])
        n = 0
        while n < len(exists) and exists[n] == 1:
            n += 1
        return n

    def _tiers(self, keys: list[str]) -> list[str]:
        """Each block's tier: `mooncake` with a replica in a node's DRAM, else `mooncake_disk`."""
        replicas = self.store.batch_get_replica_desc(keys)
        return [
            "mooncake"
            if any(r.is_memory_replica() for r in replicas.get(key, ()))
            else "mooncake_disk"
            for key in keys
        ]

    def _get(self, block_hashes: list[int]) -> tuple[torch.Tensor, list[str]] | None:
        """The leading blocks that arrive, [layers, blocks, ...], and each one's tier (None:
        not the first)."""
        n = self._num_stored(block_hashes)
        if not n:
            return None
        keys = [self.key(h) for h in block_hashes[:n]]
        tiers = self._tiers(keys)
        size = self.bytes_per_block
        buffer = torch.empty(n * size, dtype=torch.uint8)  # this call's own: see the docstring
        address = buffer.data_ptr()
        if self.store.register_buffer(address, buffer.nbytes) != 0:
            raise OSError("Mooncake cannot register a read buffer")
        try:
            got = self.store.batch_get_into(
                keys,
                [address + i * size for i in range(n)],
                [size] * n,
            )
        finally:
            self.store.unregister_buffer(address)
        arrived = 0
        while arrived < n and got[arrived] == size:
            arrived += 1
        if not arrived:
            return None
        blocks = buffer[: arrived * size].view(self.dtype).view(arrived, *self.block_shape)
        # [layers, blocks, ...], as KVConnector.write takes it
        return blocks.transpose(0, 1), tiers[:arrived]

    def _land(self, block_hashes: list[int], data: torch.Tensor) -> Reservation:
        """On the engine thread: reserves the blocks and copies in those not cached meanwhile."""
        reservation = self.kv.reserve(len(block_hashes), block_hashes)
        if reservation.fresh_blocks:
            self.kv.write(reservation, data[:, reservation.num_cached :])
        return reservation

    async def load_prefix(
        self, request_id: str, prompt: list[int], cache_salt: str = ""
    ) -> Loaded | None:
        """Loads the stored blocks of the prompt's prefix this worker lacks into reserved
        blocks; None when there are none (or Mooncake failed or ran past the deadline)."""
        if not self.loads.available():
            return None
        started_at = time.monotonic()
        hashes = hash_blocks(prompt, self.block_size, salt_root(cache_salt))
        hashes = hashes[: (len(prompt) - 1) // self.block_size]
        local = self.kv.num_cached_blocks(hashes)  # a hint, read off the engine thread
        if local == len(hashes):
            return None
        wanted = hashes[local:]
        try:
            got = await self._call(self._get, wanted)
            self.loads.succeeded()
            if got is None:
                return None
            data, tiers = got
            loaded = wanted[: data.shape[1]]
            reservation = await self.loop.acall(self._land, loaded, data)
        except MemoryError:  # no room in the pool now: computed instead
            return None
        except Exception as exc:
            self.loads.failed(started_at, exc)
            return None
        self.num_loaded_blocks += len(loaded)
        return Loaded(reservation, loaded, tiers, local, self.block_size)

    def offer(self, prompt: list[int], cache_salt: str = "") -> None:
        """Write-through of the prompt's full blocks, in the background."""
        if self.writes.available():
            task = asyncio.create_task(
                self._offer(prompt, cache_salt), name=f"mooncake-put-{uuid.uuid4()}"
            )
            self._offers.add(task)
            task.add_done_callback(self._offers.discard)

    def _missing(self, block_hashes: list[int]) -> list[int]:
        exists = self.store.batch_is_exist([self.key(h) for h in block_hashes])
        return [h for h, e in zip(block_hashes, exists, strict=True) if e != 1]

    def _put(self, block_hashes: list[int], data: torch.Tensor) -> int:
        """Puts `data` [layers, blocks, ...] under the blocks' keys; returns how many the pool
        refused for want of room."""
        size = self.bytes_per_block
        n = len(block_hashes)
        buffer = torch.empty(n * size, dtype=torch.uint8)
        buffer.view(self.dtype).view(n, *self.block_shape).copy_(data.transpose(0, 1))
        address = buffer.data_ptr()
        if self.store.register_buffer(address, buffer.nbytes) != 0:
            raise OSError("Mooncake cannot register a write buffer")
        try:
            codes = self.store.batch_put_from(
                [self.key(h) for h in block_hashes],
                [address + i * size for i in range(n)],
                [size] * n,
                self.put_config,
            )
        finally:
            self.store.unregister_buffer(address)
        failed = [c for c in codes if c not in (0, OBJECT_ALREADY_EXISTS, NO_AVAILABLE_HANDLE)]
        if failed:
            raise OSError(f"Mooncake refused {len(failed)} of {n} blocks (code {failed[0]})")
        return codes.count(NO_AVAILABLE_HANDLE)

    async def _offer(self, prompt: list[int], cache_salt: str) -> None:
        started_at = time.monotonic()
        hashes = hash_blocks(prompt, self.block_size, salt_root(cache_salt))
        try:
            missing = await self._call(self._missing, hashes)
            if not missing:
                return
            found, data = await self.loop.acall(self.kv.read, missing)
            if found and await self._call(self._put, found, data):
                metrics.count_store_full()
            self.writes.succeeded()
        except Exception as exc:  # a put is best effort: never an error for a request
            self.writes.failed(started_at, exc)

    def close(self) -> None:
        """At shutdown (the event loop's tasks are going): leaves the pool."""
        self.threads.shutdown(wait=False, cancel_futures=True)
        self.store.close()
