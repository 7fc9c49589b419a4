"""The KV store's storage: round trips on both tiers, LRU and the disk admission rule, leases,
invisible puts, a restart that rebuilds the disk index, corrupt files never served, and
namespaces that never meet."""

from __future__ import annotations

import os

import pytest

from services.kvcache.disk import DiskTier
from services.kvcache.keys import namespace
from services.kvcache.store import BlockStore

NS = namespace("tandem-demo@abc", "float32", 16, [4, 2, 16, 2, 32])
BLOCK = 1000  # bytes in these tests


def block(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(BLOCK))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def disk(tmp_path):
    return DiskTier(str(tmp_path / "disk"), capacity_bytes=100 * BLOCK)


def test_put_get_lookup_round_trip_byte_equal_from_dram_and_from_disk(disk):
    store = BlockStore(dram_bytes=3 * BLOCK, disk=disk)
    for i in range(3):
        assert store.put((NS, i), block(i))
    lease = store.acquire(NS, [0, 1, 2, 99], lease_s=10)
    assert lease.blocks == [block(0), block(1), block(2)] and lease.tiers == ["dram"] * 3
    store.release(lease.id)
    for i in range(3, 6):  # pushes 0-2 out of DRAM; they were read, so they go to disk
        store.put((NS, i), block(i))
    disk.flush()
    assert store.lookup(NS, [0, 1, 2, 3]) == ["disk", "disk", "disk", "dram"]
    lease = store.acquire(NS, [0, 1], lease_s=10)
    assert lease.blocks == [block(0), block(1)] and lease.tiers == ["disk", "disk"]
    assert store.lookup(NS, [0, 1]) == ["dram", "dram"]  # promoted
    assert store.stats.disk.hits == 2


def test_lru_eviction_and_only_blocks_used_twice_reach_disk(disk):
    store = BlockStore(dram_bytes=2 * BLOCK, disk=disk)
    store.put((NS, 1), block(1))
    store.put((NS, 2), block(2))
    store.release(store.acquire(NS, [2], lease_s=10).id)  # 2 is used again; 1 is not
    store.put((NS, 3), block(3))  # evicts 1 (least recently used): dropped
    store.put((NS, 4), block(4))  # evicts 2: admitted to disk
    disk.flush()
    assert store.lookup(NS, [1]) == [] and store.lookup(NS, [2]) == ["disk"]
    assert store.stats.dram.evictions == 2 and len(disk) == 1


def test_with_disk_admission_at_one_use_every_evicted_block_reaches_disk(disk):
    store = BlockStore(dram_bytes=2 * BLOCK, disk=disk)
    store.disk_admission_uses = 1  # the store's --disk-admission-uses 1
    for i in range(1, 5):  # 1 and 2 are evicted, neither read again
        store.put((NS, i), block(i))
    disk.flush()
    assert store.lookup(NS, [1]) == ["disk"] and store.lookup(NS, [2]) == ["disk"]
    lease = store.acquire(NS, [1], lease_s=10)
    assert lease.blocks == [block(1)] and lease.tiers == ["disk"]


def test_a_leased_block_is_not_evicted_until_released_or_expired(disk):
    clock = Clock()
    store = BlockStore(dram_bytes=2 * BLOCK, disk=None, clock=clock)
    store.put((NS, 1), block(1))
    store.put((NS, 2), block(2))
    lease = store.acquire(NS, [1, 2], lease_s=5)
    assert not store.put((NS, 3), block(3))  # everything pinned: refused, nothing evicted
    assert store.lookup(NS, [1, 2]) == ["dram", "dram"]
    clock.now = 6  # the reader never released: its lease expires
    assert store.put((NS, 3), block(3))
    assert store.lookup(NS, [3]) == ["dram"] and store.lookup(NS, [1]) == []
    store.release(lease.id)  # late: harmless


def test_a_put_is_invisible_until_committed_and_a_duplicate_is_not_stored_twice():
    store = BlockStore(dram_bytes=10 * BLOCK)
    pending = store.begin_put((NS, 7))  # its bytes are arriving
    assert store.lookup(NS, [7]) == [] and store.acquire(NS, [7], lease_s=1).blocks == []
    assert store.begin_put((NS, 7)) is None  # a second writer of the same block sends nothing
    assert store.commit_put(pending, block(7))
    assert store.acquire(NS, [7], lease_s=1).blocks == [block(7)]
    assert store.begin_put((NS, 7)) is None and store.stats.num_duplicate_puts == 2
    aborted = store.begin_put((NS, 8))
    store.abort_put(aborted)
    assert store.lookup(NS, [8]) == []


def test_a_restart_rebuilds_the_disk_index(tmp_path):
    first = DiskTier(str(tmp_path / "disk"), capacity_bytes=100 * BLOCK)
    for i in range(4):
        first.write((NS, i), block(i))
    first.flush()
    again = DiskTier(str(tmp_path / "disk"), capacity_bytes=100 * BLOCK)  # a new store process
    store = BlockStore(dram_bytes=10 * BLOCK, disk=again)
    assert store.lookup(NS, [0, 1, 2, 3]) == ["disk"] * 4
    assert store.acquire(NS, [0, 1, 2, 3], lease_s=1).blocks == [block(i) for i in range(4)]


def test_corrupt_and_truncated_files_are_never_served(tmp_path):
    disk = DiskTier(str(tmp_path / "disk"), capacity_bytes=100 * BLOCK)
    for i in range(3):
        disk.write((NS, i), block(i))
    disk.flush()
    with open(disk.path((NS, 1)), "r+b") as f:  # one flipped byte in the payload
        f.seek(-10, os.SEEK_END)
        f.write(b"\x00\xff")
    with open(disk.path((NS, 2)), "r+b") as f:
        f.truncate(100)  # cut short
    store = BlockStore(
        dram_bytes=10 * BLOCK, disk=DiskTier(str(tmp_path / "disk"), capacity_bytes=100 * BLOCK)
    )
    # the truncated one, at start
    assert store.disk.num_corrupt == 1 and store.lookup(NS, [2]) == []
    lease = store.acquire(NS, [0, 1], lease_s=1)
    assert lease.blocks == [block(0)]  # the corrupt one is a miss, and is gone
    assert store.disk.num_corrupt == 2 and not os.path.exists(store.disk.path((NS, 1)))


def test_blocks_of_another_model_dtype_or_layout_never_hit(disk):
    store = BlockStore(dram_bytes=10 * BLOCK, disk=disk)
    store.put((NS, 1), block(1))
    for other in (
        namespace("another-model", "float32", 16, [4, 2, 16, 2, 32]),
        namespace("tandem-demo@abc", "bfloat16", 16, [4, 2, 16, 2, 32]),
        namespace("tandem-demo@abc", "float32", 32, [4, 2, 32, 2, 32]),
        namespace("tandem-demo@abc", "float32", 16, [4, 2, 16, 4, 16]),
    ):
        assert other != NS
        assert store.lookup(other, [1]) == [] and store.acquire(other, [1], lease_s=1).blocks == []


def test_the_disk_tier_stays_within_its_size(tmp_path):
    disk = DiskTier(str(tmp_path / "disk"), capacity_bytes=3 * (BLOCK + 100))
    for i in range(6):
        disk.write((NS, i), block(i))
    disk.flush()
    assert len(disk) == 3 and disk.nbytes <= disk.capacity_bytes and disk.num_evictions == 3
    assert (NS, 5) in disk and (NS, 0) not in disk  # the oldest went first


def test_a_full_disk_is_reported_and_the_store_serves_on_from_dram(tmp_path, monkeypatch):
    import errno

    from services.kvcache import disk as disk_module

    disk = DiskTier(str(tmp_path / "disk"), capacity_bytes=100 * BLOCK)
    real_open = open

    def full(path, mode="r", *args, **kwargs):
        if "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(disk_module, "open", full, raising=False)
    store = BlockStore(dram_bytes=2 * BLOCK, disk=disk)
    for i in range(4):  # each read once, then evicted: admitted to disk, where writes now fail
        store.put((NS, i), block(i))
        store.release(store.acquire(NS, [i], lease_s=1).id)
    disk.flush()
    assert disk.disk_full and len(disk) == 0
    assert not os.listdir(tmp_path / "disk") or all(
        not f.endswith(".partial") for _, _, fs in os.walk(tmp_path / "disk") for f in fs
    )
    assert store.acquire(NS, [3], lease_s=1).blocks == [block(3)]  # DRAM serves on
    # and disk writes are dropped, counted, until the retry period
    assert not disk.write((NS, 9), block(9))
    assert disk.num_dropped_writes >= 1
