"""The disk tier: one file per block under a directory, bounded in total size, surviving
restarts of the store.

File: `<dir>/<namespace>/<block hash, 16 hex digits>.kv` =
    b"TKV1" | payload length (u64 little-endian) | BLAKE2b-256 of the payload | payload
written to a temporary name and renamed, so a reader never sees half a file. On start the
tier rebuilds its index from the files (oldest modification first in the LRU), dropping any
whose size does not match its header (truncated). Every read checks the digest: a corrupt
file is deleted, logged and counted, never served.

Writes never block a request: `write` queues the block for a writer thread and returns; a
full queue drops the write (counted). When the disk is full (ENOSPC) the tier stops writing,
reports `disk_full`, and keeps serving what it has; it retries after `RETRY_FULL_S`.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from engine.progress import Stage
from services.kvcache.keys import Key

log = logging.getLogger(__name__)

MAGIC = b"TKV1"
HEADER = struct.Struct("<4sQ32s")
MAX_QUEUED_WRITES = 1024
RETRY_FULL_S = 30.0


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=32).digest()


class DiskTier:
    def __init__(self, directory: str, capacity_bytes: int):
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0
        self.num_corrupt = self.num_dropped_writes = self.num_evictions = 0
        self.disk_full_since: float | None = None
        # key -> file size, least recently used first
        self._files: OrderedDict[Key, int] = OrderedDict()
        self._lock = threading.Lock()
        self._writes: queue.Queue = queue.Queue(MAX_QUEUED_WRITES)
        # a file written or dropped (any thread)
        self.on_change: Callable[[Key], None] = lambda key: None
        os.makedirs(directory, exist_ok=True)
        self._rebuild_index()
        self._writer = threading.Thread(
            target=self._write_forever, name="kvcache-disk-writer", daemon=True
        )
        self._writer.start()

    @property
    def disk_full(self) -> bool:
        return self.disk_full_since is not None

    def __contains__(self, key: Key) -> bool:
        with self._lock:
            return key in self._files

    def __len__(self) -> int:
        return len(self._files)

    def keys(self) -> list[Key]:
        with self._lock:
            return list(self._files)

    def path(self, key: Key) -> str:
        return os.path.join(self.directory, key[0], f"{key[1]:016x}.kv")

    def _rebuild_index(self) -> None:
        names = [
            (namespace, os.listdir(os.path.join(self.directory, namespace)))
            for namespace in sorted(os.listdir(self.directory))
            if os.path.isdir(os.path.join(self.directory, namespace))
        ]
        num_files = sum(len(files) for _, files in names)
        if not num_files:
            return
        found = []
        # A header read per file: a large tier takes a while, so its progress shows (stderr).
        with Stage(f"disk tier: reloading {self.directory}", num_files, "files") as progress:
            for namespace, files in names:
                for name in files:
                    progress.advance()
                    entry = self._entry(namespace, name)
                    if entry is not None:
                        found.append(entry)
            for _, key, size in sorted(found):
                self._files[key] = size
                self.nbytes += size
            progress.detail = f"{len(found)} blocks, {self.nbytes / 2**20:.1f} MiB"

    def _entry(self, namespace: str, name: str) -> tuple[int, Key, int] | None:
        """(modified, key, size) of a block's file; None for a file that is not one (a
        truncated one and a write the last run did not finish are deleted)."""
        path = os.path.join(self.directory, namespace, name)
        if not name.endswith(".kv"):
            if name.endswith(".partial"):
                os.unlink(path)
            return None
        stat = os.stat(path)
        if not self._size_matches(path, stat.st_size):
            log.warning("dropping truncated KV file %s", path)
            self.num_corrupt += 1
            os.unlink(path)
            return None
        return stat.st_mtime_ns, (namespace, int(name[:-3], 16)), stat.st_size

    @staticmethod
    def _size_matches(path: str, size: int) -> bool:
        try:
            with open(path, "rb") as f:
                magic, length, _ = HEADER.unpack(f.read(HEADER.size))
        except (OSError, struct.error):
            return False
        return magic == MAGIC and HEADER.size + length == size

    def read(self, key: Key) -> bytes | None:
        """The block's bytes, checked; None when absent, corrupt or unreadable."""
        with self._lock:
            if key not in self._files:
                return None
            self._files.move_to_end(key)
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                magic, length, digest = HEADER.unpack(f.read(HEADER.size))
                data = f.read()
        except (OSError, struct.error) as exc:
            return self._drop_corrupt(key, path, f"unreadable: {exc}")
        if magic != MAGIC or len(data) != length or _digest(data) != digest:
            return self._drop_corrupt(key, path, "checksum or length mismatch")
        return data

    def _drop_corrupt(self, key: Key, path: str, why: str) -> None:
        log.warning("dropping corrupt KV file %s (%s)", path, why)
        self.num_corrupt += 1
        self._remove(key)
        return None

    def write(self, key: Key, data: bytes) -> bool:
        """Queues the block for the writer thread; False when it was dropped (queue full, disk full)."""
        if self.disk_full and time.monotonic() - self.disk_full_since < RETRY_FULL_S:
            self.num_dropped_writes += 1
            return False
        try:
            self._writes.put_nowait((key, data))
            return True
        except queue.Full:
            self.num_dropped_writes += 1
            return False

    def flush(self, timeout_s: float = 10.0) -> None:
        """Waits until every queued write is on disk (tests, shutdown)."""
        done = threading.Event()
        self._writes.put((None, done))
        done.wait(timeout_s)

    def _write_forever(self) -> None:
        while True:
            key, data = self._writes.get()
            if key is None:
                data.set()
                continue
            try:
                self._write(key, data)
            except Exception:  # never let the writer die
                log.exception("disk tier: writing %s failed", key)

    def _write(self, key: Key, data: bytes) -> None:
        size = HEADER.size + len(data)
        if key in self or size > self.capacity_bytes:
            return
        self._evict_for(size)
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = path + ".partial"
        try:
            with open(partial, "wb") as f:
                f.write(HEADER.pack(MAGIC, len(data), _digest(data)))
                f.write(data)
            os.replace(partial, path)
        except OSError as exc:
            if os.path.exists(partial):
                os.unlink(partial)
            if exc.errno == errno.ENOSPC:
                if not self.disk_full:
                    log.warning(
                        "disk tier: the disk is full; serving from DRAM and what is on disk"
                    )
                self.disk_full_since = time.monotonic()
                return
            raise
        self.disk_full_since = None
        with self._lock:
            self._files[key] = size
            self.nbytes += size
        self.on_change(key)

    def _evict_for(self, size: int) -> None:
        while True:
            with self._lock:
                if not self._files or self.nbytes + size <= self.capacity_bytes:
                    return
                key = next(iter(self._files))
            self._remove(key)
            self.num_evictions += 1

    def _remove(self, key: Key) -> None:
        with self._lock:
            size = self._files.pop(key, None)
            if size is None:
                return
            self.nbytes -= size
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass
        self.on_change(key)
