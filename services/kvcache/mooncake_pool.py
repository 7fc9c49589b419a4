"""Joining a Mooncake Store pool (`KV_STORE=mooncake`), the same for its store nodes, the
workers and the gateway: the pool's address and one client of it.

A pool is named `mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT`: the mooncake_master's
RPC and its HTTP metadata server. Its objects are keyed `<namespace>/<block hash, hex>`
(services/kvcache/keys.py): the namespaced chained hashes routing and the built-in store use.

A node may also give the pool a disk tier (`disk_dir`, `disk_bytes`): Mooncake's SSD offload.
The master (started with `--enable_offload --offload_on_evict`, deploy/mooncake.py) picks the
blocks to evict from a node's DRAM, the node writes them to its directory (in buckets, on its
offload heartbeat) and reports them as `LOCAL_DISK` replicas, and only then does their DRAM
go. A client's read of a block held on disk only is served by that node's offload RPC server:
the same `batch_get_into`, no call of ours. `offload_environment` holds the settings, as
Mooncake reads them from the node's environment.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import parse_qs, urlparse

SCHEME = "mooncake://"
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
NO_AVAILABLE_HANDLE = -200  # a put refused: no segment has room now (the pool is full)
# A disk bucket is written (and evicted, LRU) whole once it has this many blocks; Mooncake's
# 500 holds a node's blocks in DRAM until 500 are waiting, and evicts 500 at a time.
BUCKET_KEYS = 64
BUCKET_BYTES = 32 << 20
STAGING_BYTES = 128 << 20  # a node's buffer for disk reads served to clients


def parse_address(address: str) -> tuple[str, str]:
    """`mooncake://HOST:PORT?metadata=http://HOST:PORT` -> (master, metadata server)."""
    url = urlparse(address)
    metadata = parse_qs(url.query).get("metadata", [""])[0]
    if url.scheme != "mooncake" or not url.netloc or not metadata:
        raise ValueError(
            f"--kv-store {address!r}: a Mooncake pool is mooncake://MASTER_HOST:PORT"
            "?metadata=http://HOST:PORT"
        )
    return url.netloc, metadata


def block_key(namespace: str, block_hash: int) -> str:
    return f"{namespace}/{block_hash:x}"


def offload_environment(disk_dir: str, disk_bytes: int) -> dict[str, str]:
    """Mooncake's SSD offload settings for a node whose disk tier is `disk_bytes` in
    `disk_dir` (an absolute path to an existing directory; Mooncake refuses others)."""
    return {
        "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": disk_dir,
        "MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "bucket_storage_backend",
        # Both caps: the logical one, and the bytes really on disk (a bucket file stays until
        # all its blocks are evicted).
        "MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE": str(disk_bytes),
        "MOONCAKE_OFFLOAD_BUCKET_MAX_PHYSICAL_BYTES": str(disk_bytes),
        "MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY": "lru",
        "MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT": str(BUCKET_KEYS),
        "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(min(BUCKET_BYTES, disk_bytes)),
        # Blocks chosen for eviction keep their DRAM until written: write them every second,
        # not every 10 s, or puts find the pool full meanwhile.
        "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
        "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(STAGING_BYTES),
    }


def connect(
    address: str,
    host: str,
    segment_bytes: int = 0,
    timeout_s: float | None = None,
    disk_dir: str = "",
    disk_bytes: int = 0,
):
    """A Mooncake client of the pool contributing `segment_bytes` of this process's memory (0:
    none, a client only) and, given `disk_dir` and `disk_bytes`, that much disk below it (a
    node's disk tier). `timeout_s` bounds its calls to the master (Mooncake's own: 30 s)."""
    master, metadata = parse_address(address)
    offload = bool(disk_dir and disk_bytes)
    if offload:
        disk_dir = os.path.realpath(disk_dir)
        os.makedirs(disk_dir, exist_ok=True)
        for name, value in offload_environment(disk_dir, disk_bytes).items():
            os.environ.setdefault(name, value)  # an operator's own setting wins
    if timeout_s is not None:
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(int(timeout_s * 1000)))
        os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", str(int(timeout_s * 1000)))
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    ip = socket.gethostbyname(host)
    if ipaddress.ip_address(ip).is_loopback:
        # Mooncake serves its transfers on the first non-loopback address it finds, and fails
        # ("not valid LAN address found") where there is none: keep a local pool on loopback.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", ip)
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(
        host,
        metadata.rstrip("/") + "/metadata",
        segment_bytes,
        16 << 20,
        "tcp",
        "",
        master,
        None,
        offload,
        disk_dir if offload else "",
    )
    if code != 0:
        raise OSError(f"cannot join the Mooncake master at {master} (code {code})")
    return store
