"""Which workers hold which KV blocks: chained block hash -> the workers that have it cached.

Fed by every worker's KV events (kv_events.py). Each worker gets a slot (a bit), and the
index maps a block hash to the bitmask of the workers holding it, so one dict entry serves
the whole fleet: about 100 bytes per distinct cached block (the dict slot, the 64-bit hash
key and a small int), ~100 MB per million blocks (`tests/unit/gateway/test_prefix_index.py`
measures it). Dropping a worker (it restarted, left, or its stream broke) clears its bit from
every entry at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class PrefixIndex:
    def __init__(self):
        self._holders: dict[int, int] = {}  # block hash -> bitmask of worker slots
        self._slots: dict[Hashable, int] = {}  # worker key -> its slot
        self._free_slots: list[int] = []
        self._num_blocks: dict[Hashable, int] = {}  # worker key -> blocks it holds
        self.num_hits = 0  # lookups that found a cached prefix somewhere
        self.num_lookups = 0

    def __len__(self) -> int:
        return len(self._holders)

    @property
    def workers(self) -> list[Hashable]:
        return list(self._slots)

    def _slot(self, worker: Hashable) -> int:
        if worker not in self._slots:
            self._slots[worker] = self._free_slots.pop() if self._free_slots else len(self._slots)
        return self._slots[worker]

    def stored(self, worker: Hashable, block_hashes: Iterable[int]) -> None:
        bit = 1 << self._slot(worker)
        holders, num_new = self._holders, 0
        for block_hash in block_hashes:
            mask = holders.get(block_hash, 0)
            if not mask & bit:
                holders[block_hash] = mask | bit
                num_new += 1
        self._num_blocks[worker] = self._num_blocks.get(worker, 0) + num_new

    def evicted(self, worker: Hashable, block_hashes: Iterable[int]) -> None:
        if worker not in self._slots:
            return
        bit = 1 << self._slots[worker]
        holders, num_gone = self._holders, 0
        for block_hash in block_hashes:
            mask = holders.get(block_hash, 0)
            if not mask & bit:
                continue
            num_gone += 1
            if mask & ~bit:
                holders[block_hash] = mask & ~bit
            else:
                del holders[block_hash]
        self._num_blocks[worker] -= num_gone

    def drop(self, worker: Hashable) -> None:
        """Forget every block of `worker` (restart, gone, or its events can no longer be trusted)."""
        slot = self._slots.pop(worker, None)
        if slot is None:
            return
        self._num_blocks.pop(worker, None)
        keep = ~(1 << slot)
        self._holders = {h: mask & keep for h, mask in self._holders.items() if mask & keep}
        self._free_slots.append(slot)

    def num_blocks_of(self, worker: Hashable) -> int:
        """Blocks `worker` holds cached (counted as events arrive: no scan)."""
        return self._num_blocks.get(worker, 0)

    def match(self, block_hashes: list[int], workers: list[Hashable]) -> dict[Hashable, int]:
        """For each of `workers`, how many leading blocks of the chain it holds cached."""
        bits = {w: 1 << self._slots[w] for w in workers if w in self._slots}
        matched = dict.fromkeys(workers, 0)
        alive = sum(bits.values())
        for i, block_hash in enumerate(block_hashes):
            if not alive:
                break
            alive &= self._holders.get(block_hash, 0)
            for worker, bit in bits.items():
                if alive & bit:
                    matched[worker] = i + 1
        self.num_lookups += 1
        self.num_hits += any(matched.values())
        return matched
