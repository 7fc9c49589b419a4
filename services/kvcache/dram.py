"""The DRAM tier: a bounded LRU of blocks in process memory.

Each entry counts its uses (1 for the put, 1 for every read) and its pins (readers holding a
lease). Eviction takes the least recently used entries that nobody pins, until the new block
fits; it hands them back to the caller, which decides whether they go to disk.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from services.kvcache.keys import Key


@dataclass
class Entry:
    data: bytes
    uses: int = 1
    pins: int = 0


class DRAMTier:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self._entries: OrderedDict[Key, Entry] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[tuple[Key, Entry]]:
        return list(self._entries.items())

    def get(self, key: Key) -> Entry | None:
        """The entry, now the most recently used and counted as used once more."""
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            entry.uses += 1
        return entry

    def put(self, key: Key, data: bytes, uses: int = 1) -> list[tuple[Key, Entry]] | None:
        """Stores the block; returns what it evicted to make room, or None (nothing stored)
        when pinned entries leave no room."""
        if key in self._entries:
            self.get(key)
            return []
        evicted = self._make_room(len(data))
        if evicted is None:
            return None
        self._entries[key] = Entry(data, uses)
        self.nbytes += len(data)
        return evicted

    def _make_room(self, nbytes: int) -> list[tuple[Key, Entry]] | None:
        if nbytes > self.capacity_bytes:
            return None
        victims, freed = [], 0
        for key, entry in self._entries.items():  # least recently used first
            if self.nbytes - freed + nbytes <= self.capacity_bytes:
                break
            if not entry.pins:
                victims.append(key)
                freed += len(entry.data)
        if self.nbytes - freed + nbytes > self.capacity_bytes:
            return None
        evicted = [(key, self._entries.pop(key)) for key in victims]
        self.nbytes -= freed
        return evicted

    def pin(self, key: Key) -> None:
        self._entries[key].pins += 1

    def unpin(self, key: Key) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.pins:
            entry.pins -= 1
