"""Which KV block holds what: allocation, reference counts, prefix cache, LRU eviction, events.

This module owns block *ids* only; the bytes live in `engine.kv_cache.KVCache`.

- A block is in use while its reference count is above zero (several sequences may share a
  cached prefix block).
- A full block whose KV has been computed is registered under its chained hash
  (`engine.block_hash`). When its last user lets go it stays cached, at the tail of the free
  queue; allocation takes blocks from the head, so free cached blocks are evicted least
  recently used first.
- Every registration and eviction is recorded as a `KVEvent`, drained by whoever feeds a
  global index (the gateway's KV-aware router, the KV store).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from engine.block_hash import extend_hashes
from engine.sequence import Sequence


@dataclass(frozen=True)
class KVEvent:
    kind: Literal["stored", "evicted"]
    block_hashes: tuple[int, ...]


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Free blocks in eviction order: head is taken first. Values unused (an ordered set).
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.events: list[KVEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the sequence's leading full blocks (not yet taken).

        At least one token is left uncached so the step that finishes the prompt has a
        position to sample from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        extend_hashes(
            seq.block_hashes,
            seq.token_ids,
            self.block_size,
            max_blocks * self.block_size,
            seq.root_hash,
        )
        hits = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.hash_to_block.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()
    ) -> bool:
        # Cached blocks nobody uses sit in the free queue; taking them shrinks it too.
        num_reclaimed = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        needed = -(-(len(cached_blocks) * self.block_size + num_new_tokens) // self.block_size)
        return needed - len(cached_blocks) + num_reclaimed <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> None:
        """Start a sequence's block table: take its cached prefix blocks, then fresh ones."""
        assert not seq.block_table, "allocate() starts a block table; use append() to grow it"
        for block in cached_blocks:
            self._take(block)
        seq.block_table = list(cached_blocks)
        seq.num_registered_blocks = len(cached_blocks)
        seq.num_computed_tokens = len(cached_blocks) * self.block_size
        self.append(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to hold `num_new_tokens` more tokens of KV."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._allocate_fresh())

    def take_cached(self, block_hashes) -> list[int]:
        """The cached blocks holding the leading `block_hashes`, each now held once more."""
        blocks = []
        for block_hash in block_hashes:
            block = self.hash_to_block.get(block_hash) if self.enable_prefix_caching else None
            if block is None:
                break
            self._take(block)
            blocks.append(block)
        return blocks

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        """Fresh blocks outside any sequence (KV import); release with `free_blocks`."""
        if num_blocks > self.num_free_blocks:
            raise MemoryError(f"need {num_blocks} KV blocks, {self.num_free_blocks} free")
        return [self._allocate_fresh() for _ in range(num_blocks)]

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks. Tail first, so prefixes outlive suffixes."""
        self.free_blocks(reversed(seq.block_table))
        seq.block_table = []
        seq.num_registered_blocks = 0

    def trim(self, seq: Sequence) -> None:
        """Lets go of the blocks past those holding the sequence's computed KV (blocks that
        held only rejected draft tokens: never registered, so never in the prefix cache)."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        if len(seq.block_table) > keep:
            self.free_blocks(reversed(seq.block_table[keep:]))
            del seq.block_table[keep:]

    def free_blocks(self, blocks) -> None:
        for block in blocks:
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register every full block whose KV is now computed under its chained hash."""
        if not self.enable_prefix_caching:
            return
        extend_hashes(
            seq.block_hashes, seq.token_ids, self.block_size, seq.num_computed_tokens, seq.root_hash
        )
        end = seq.num_computed_tokens // self.block_size
        start, seq.num_registered_blocks = seq.num_registered_blocks, end
        self.register(seq.block_table[start:end], seq.block_hashes[start:end])

    def register(self, blocks: list[int], hashes: list[int]) -> None:
        stored = []
        for block, block_hash in zip(blocks, hashes):
            if self.block_hash[block] is not None or block_hash in self.hash_to_block:
                continue  # already cached (here or as a twin computed concurrently)
            self.block_hash[block] = block_hash
            self.hash_to_block[block_hash] = block
            stored.append(block_hash)
        if stored:
            self.events.append(KVEvent("stored", tuple(stored)))

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _allocate_fresh(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        old_hash = self.block_hash[block]
        if old_hash is not None:  # evict the least recently used cached block
            del self.hash_to_block[old_hash]
            self.block_hash[block] = None
            self.events.append(KVEvent("evicted", (old_hash,)))
        self.ref_counts[block] = 1
        return block
