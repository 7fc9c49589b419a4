"""The engine's KV as seen from outside the step, keyed by block hash: what is cached here,
blocks loaded into reserved room, blocks saved out, a prefilled prompt's export.

Every path that moves KV in or out of a worker goes through one `KVConnector`:
- prefill -> decode: the prefill engine `export`s a prompt's blocks with its first token; the
  decode side `reserve`s room (sharing the leading blocks it has cached), a transport writes
  the bytes into the `landing` buffers, and `LLMEngine.add(AddRequest(kv=FromPrefill(...)))`
  `settle`s them and admits the request;
- the KV store's loads: the same reserve -> landing, then `AddRequest(kv=FromStore(...))`
  `settle`s and `cache`s them into the prefix cache just before the request is queued;
- the store's write-through: `read` copies out the blocks of given hashes still cached here.

The bytes are always in one whole engine's layout (`KVLayout.block_shape`), whatever the
parallelism: a parallel engine's connector gathers from and scatters to its ranks' pools
(engine/parallel/kv_blocks.py). A new transport fills `landing` buffers and reads `export`s;
a new store is one more user of `num_cached_blocks` / `reserve` / `read`; a new place the
engine's blocks live (another pool layout) is one more implementation of this class.

Thread rules: `layout`, `num_cached_blocks` (a hint) and `landing` may be called from any
thread; the rest only on the engine's thread, between steps (the worker's engine loop).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from engine.block_manager import BlockManager, KVEvent
from engine.kv_cache import KVCache
from engine.outputs import KVExport
from engine.parallel.kv_blocks import ParallelKV
from engine.requests import Reservation
from engine.sequence import Sequence


@dataclass(frozen=True)
class KVLayout:
    """What a block of this engine's KV looks like outside it."""

    block_size: int  # tokens per block
    # one block, the whole model's: [layers, entries, block_size, kv_heads, head_dim]
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    num_blocks: int  # the pool's (the most one request or transfer can ever hold)

    @property
    def dtype_name(self) -> str:
        """As transfer headers and the store name it: "bfloat16", "float32"."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.block_shape) * self.dtype.itemsize

    def transfer_shape(self, num_blocks: int) -> list[int]:
        """[layers, num_blocks, entries, block_size, kv_heads, head_dim]: what `export` and `read` return."""
        return [self.block_shape[0], num_blocks, *self.block_shape[1:]]


class KVConnector(ABC):
    layout: KVLayout

    # Look up.

    @abstractmethod
    def num_cached_blocks(self, block_hashes: list[int]) -> int:
        """How many leading blocks of the chain are cached here (off the engine thread: a hint,
        a block may be evicted meanwhile)."""

    @abstractmethod
    def cached_block_hashes(self) -> list[int]:
        """Every block hash cached now (a KV events subscriber's snapshot)."""

    @abstractmethod
    def drain_events(self) -> list[KVEvent]:
        """Blocks stored into and evicted from the prefix cache since the last drain."""

    # Load into reserved blocks.

    @abstractmethod
    def reserve(self, num_blocks: int, block_hashes: list[int] = ()) -> Reservation:
        """Room for `num_blocks` blocks of KV arriving from elsewhere: the cached blocks that hold
        its leading `block_hashes` (shared, not copied), then fresh ones. No running sequence
        reads the fresh ones, so a transport may fill them while the engine steps. Raises
        MemoryError, holding nothing, when the pool has no room now. Ends in `LLMEngine.add`
        (which owns the blocks from then on) or `free`."""

    @abstractmethod
    def landing(self, reservation: Reservation) -> list[np.ndarray]:
        """Writable flat byte buffers that the fresh blocks' bytes fill, in transfer order
        ([layers, blocks, ...]): views of the pool itself where they can be."""

    @abstractmethod
    def write(self, reservation: Reservation, data: torch.Tensor) -> None:
        """Copies `data` [layers, fresh blocks, ...] into the reservation's fresh blocks."""

    @abstractmethod
    def settle(self, reservation: Reservation) -> None:
        """Before the blocks are used: bytes still staged go where the engine reads them."""

    @abstractmethod
    def free(self, reservation: Reservation) -> None:
        """Gives the reserved blocks back (their cached ones stay cached)."""

    @abstractmethod
    def cache(self, reservation: Reservation, block_hashes: list[int]) -> None:
        """Registers the filled blocks under `block_hashes` and lets go of them: they stay in
        the prefix cache, where the next admission finds them."""

    # Save and export.

    @abstractmethod
    def read(self, block_hashes: list[int]) -> tuple[list[int], torch.Tensor]:
        """A copy of the KV of those blocks still cached here, with their hashes."""

    @abstractmethod
    def export(self, seq: Sequence) -> KVExport:
        """A copy of a prefilled sequence's prompt KV, with its first token."""


class PoolConnector(KVConnector):
    """The engine's own paged pool: `block_io` is the pool itself (one process) or a
    `ParallelKV` over the ranks' pools, which hold a share each."""

    def __init__(
        self, block_manager: BlockManager, kv_cache: KVCache, block_io: KVCache | ParallelKV
    ):
        self.block_manager = block_manager
        self.kv_cache = kv_cache
        self.block_io = block_io
        # rank 0's pool holds its share only: bytes land staged
        self.staged = block_io is not kv_cache
        self.layout = KVLayout(
            kv_cache.block_size,
            tuple(block_io.block_shape),
            kv_cache.pool.dtype,
            block_manager.num_blocks,
        )

    def num_cached_blocks(self, block_hashes: list[int]) -> int:
        cached = self.block_manager.hash_to_block
        n = 0
        while n < len(block_hashes) and block_hashes[n] in cached:
            n += 1
        return n

    def cached_block_hashes(self) -> list[int]:
        return list(self.block_manager.hash_to_block)

    def drain_events(self) -> list[KVEvent]:
        return self.block_manager.drain_events()

    def reserve(self, num_blocks: int, block_hashes: list[int] = ()) -> Reservation:
        cached = self.block_manager.take_cached(list(block_hashes)[:num_blocks])
        try:
            return Reservation(
                cached + self.block_manager.allocate_blocks(num_blocks - len(cached)), len(cached)
            )
        except MemoryError:
            self.block_manager.free_blocks(cached)
            raise

    def landing(self, reservation: Reservation) -> list[np.ndarray]:
        fresh = reservation.fresh_blocks
        if self.staged:
            if reservation.staging is None:
                reservation.staging = torch.empty(
                    self.layout.transfer_shape(len(fresh)), dtype=self.layout.dtype
                )
            return [reservation.staging.view(torch.uint8).numpy().reshape(-1)]
        return _pool_segments(self.kv_cache.pool, fresh)

    def write(self, reservation: Reservation, data: torch.Tensor) -> None:
        self.block_io.write_blocks(reservation.fresh_blocks, data)

    def settle(self, reservation: Reservation) -> None:
        if reservation.staging is not None:
            self.block_io.write_blocks(reservation.fresh_blocks, reservation.staging)
            reservation.staging = None

    def free(self, reservation: Reservation) -> None:
        self.block_manager.free_blocks(reservation.blocks)

    def cache(self, reservation: Reservation, block_hashes: list[int]) -> None:
        self.block_manager.register(reservation.blocks[: len(block_hashes)], block_hashes)
        self.block_manager.free_blocks(reservation.blocks)

    def read(self, block_hashes: list[int]) -> tuple[list[int], torch.Tensor]:
        cached = self.block_manager.hash_to_block
        found = [(h, cached[h]) for h in block_hashes if h in cached]
        return [h for h, _ in found], self.block_io.read_blocks([b for _, b in found])

    def export(self, seq: Sequence) -> KVExport:
        return KVExport(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            first_token_id=seq.token_ids[seq.num_prompt_tokens],
            block_hashes=list(seq.block_hashes),
            data=self.block_io.read_blocks(seq.block_table),
        )


def _pool_segments(pool: torch.Tensor, blocks: list[int]) -> list[np.ndarray]:
    """Flat byte views of the blocks in transfer order: [layers, blocks, ...], so per layer,
    per run of adjacent block ids (each run is contiguous in the pool)."""
    runs, start = [], 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            runs.append((blocks[start], i - start))
            start = i
    return [
        pool[layer, first : first + n].view(torch.uint8).numpy().reshape(-1)
        for layer in range(pool.shape[0])
        for first, n in runs
    ]
