"""The block store: a DRAM tier over an optional disk tier, with leases.

- **Put.** `begin_put` claims a key while its bytes arrive (invisible to anyone);
  `commit_put` makes the block visible (in DRAM) at once, whole; `abort_put` drops the claim.
  A block already stored (or arriving) is not stored again: `begin_put` answers None.
- **Lookup.** The longest stored prefix of a chain of block hashes, with each block's tier.
- **Read.** `acquire` takes a lease on the longest stored prefix: disk hits are read (checked)
  and promoted to DRAM, and every leased block is pinned, so no eviction can take it from
  under the reader, until `release` or the lease's deadline, whichever comes first (a reader
  that died does not pin memory for ever).
- **Eviction and disk admission.** DRAM evicts its least recently used unpinned blocks. An
  evicted block goes to disk once it was used `disk_admission_uses` times: 2 here (stored,
  then read at least once: Dynamo's frequency filter, which spares disk writes of blocks never
  read again); the store service sets 1 (every block: `--disk-admission-uses`), because with
  DRAM as small as the workers' caches most blocks are evicted before a second use. Disk
  writes are queued, never waited on.
- **Stats** per tier: bytes, blocks, hits, misses, evictions; disk: corrupt files, dropped
  writes, disk full.
- **Changes.** `on_change(key)` is called whenever a key may have come, gone or changed tier
  (from the disk writer's thread too), for the event stream (events.py).

Single-threaded by contract: the store service calls it from its event loop (the disk tier's
writer thread is internal).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.kvcache.disk import DiskTier
from services.kvcache.dram import DRAMTier
from services.kvcache.keys import Key

DISK_ADMISSION_USES = 2


@dataclass
class PendingPut:
    key: Key


@dataclass
class Lease:
    id: int
    keys: list[Key]
    blocks: list[bytes]  # in chain order
    tiers: list[str]  # where each block was found: dram | disk
    deadline: float


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


@dataclass
class StoreStats:
    dram: TierStats = field(default_factory=TierStats)
    disk: TierStats = field(default_factory=TierStats)
    num_puts: int = 0
    num_duplicate_puts: int = 0
    num_refused_puts: int = 0  # DRAM full of pinned blocks


class BlockStore:
    def __init__(
        self,
        dram_bytes: int,
        disk: DiskTier | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.dram = DRAMTier(dram_bytes)
        self.disk = disk
        self.clock = clock
        self.stats = StoreStats()
        self._pending: dict[Key, PendingPut] = {}
        self._leases: dict[int, Lease] = {}
        self._next_lease = 1
        self.disk_admission_uses = DISK_ADMISSION_USES
        self.on_change: Callable[[Key], None] = lambda key: None
        if disk is not None:
            disk.on_change = lambda key: self.on_change(key)

    # Writes.

    def begin_put(self, key: Key) -> PendingPut | None:
        """Claims a new block; None when the store has it (or a put of it is open)."""
        if key in self.dram or (self.disk is not None and key in self.disk) or key in self._pending:
            self.stats.num_duplicate_puts += 1
            return None
        pending = self._pending[key] = PendingPut(key)
        return pending

    def commit_put(self, pending: PendingPut, data: bytes) -> bool:
        """Makes the block visible. False when DRAM has no room (everything pinned)."""
        self._pending.pop(pending.key, None)
        self._expire_leases()
        evicted = self.dram.put(pending.key, data)
        if evicted is None:
            self.stats.num_refused_puts += 1
            return False
        self.stats.num_puts += 1
        self.on_change(pending.key)
        self._spill(evicted)
        return True

    def abort_put(self, pending: PendingPut) -> None:
        self._pending.pop(pending.key, None)

    def put(self, key: Key, data: bytes) -> bool:
        pending = self.begin_put(key)
        return pending is not None and self.commit_put(pending, data)

    def _spill(self, evicted, count_evictions: bool = True) -> None:
        for key, entry in evicted:
            self.stats.dram.evictions += count_evictions
            self.on_change(key)
            if self.disk is not None and entry.uses >= self.disk_admission_uses:
                self.disk.write(key, entry.data)

    def spill_all(self) -> None:
        """On shutdown: every DRAM block the disk would admit goes there, so a restarted store
        finds it (DRAM itself does not survive)."""
        if self.disk is not None:
            self._spill(self.dram.entries(), count_evictions=False)
            self.disk.flush()

    # Reads.

    def lookup(self, namespace: str, block_hashes: list[int]) -> list[str]:
        """The tier of each block of the longest stored prefix of the chain (no side effects)."""
        tiers = []
        for block_hash in block_hashes:
            key = (namespace, block_hash)
            if key in self.dram:
                tiers.append("dram")
            elif self.disk is not None and key in self.disk:
                tiers.append("disk")
            else:
                break
        return tiers

    def tier_of(self, key: Key) -> str:
        """Where the block is now: dram, disk, or "" (not held)."""
        if key in self.dram:
            return "dram"
        return "disk" if self.disk is not None and key in self.disk else ""

    def held(self, namespace: str) -> list[tuple[int, str]]:
        """Every block of the namespace, with its tier (DRAM first where it is in both)."""
        in_dram = [key[1] for key, _ in self.dram.entries() if key[0] == namespace]
        on_disk = [
            key[1]
            for key in (self.disk.keys() if self.disk is not None else ())
            if key[0] == namespace and key not in self.dram
        ]
        return [(h, "dram") for h in in_dram] + [(h, "disk") for h in on_disk]

    def acquire(self, namespace: str, block_hashes: list[int], lease_s: float) -> Lease:
        """Leases the longest stored prefix (maybe empty): its blocks stay in DRAM, pinned,
        until `release` or `lease_s` has passed."""
        self._expire_leases()
        keys, blocks, tiers = [], [], []
        for block_hash in block_hashes:
            key = (namespace, block_hash)
            entry, tier = self.dram.get(key), "dram"
            if entry is not None:
                self.stats.dram.hits += 1
            else:
                self.stats.dram.misses += 1
                data = self.disk.read(key) if self.disk is not None else None
                if data is None:
                    self.stats.disk.misses += self.disk is not None
                    break
                self.stats.disk.hits += 1
                # promoted: it was used again
                evicted = self.dram.put(key, data, uses=self.disk_admission_uses)
                if evicted is None:  # no room to hold it for the reader
                    break
                self.on_change(key)
                self._spill(evicted)
                entry, tier = self.dram.get(key), "disk"
            self.dram.pin(key)
            keys.append(key)
            blocks.append(entry.data)
            tiers.append(tier)
        lease = Lease(self._next_lease, keys, blocks, tiers, self.clock() + lease_s)
        self._next_lease += 1
        if keys:
            self._leases[lease.id] = lease
        return lease

    def release(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            for key in lease.keys:
                self.dram.unpin(key)

    def _expire_leases(self) -> None:
        now = self.clock()
        for lease_id in [i for i, lease in self._leases.items() if lease.deadline <= now]:
            self.release(lease_id)
