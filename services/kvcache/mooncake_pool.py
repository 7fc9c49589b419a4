"""Joining a Mooncake Store pool (`KV_STORE=mooncake`), the same for its store nodes, the
workers and the gateway: the pool's address and one client of it.

A pool is named `mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT`: the mooncake_master's
RPC and its HTTP metadata server. Its objects are keyed `<namespace>/<block hash, hex>`
(services/kvcache/keys.py): the namespaced chained hashes routing and the built-in store use.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, urlparse

SCHEME = "mooncake://"
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705


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


def connect(address: str, host: str, segment_bytes: int = 0, timeout_s: float | None = None):
    """A Mooncake client of the pool contributing `segment_bytes` of this process's memory (0:
    none, a client only). `timeout_s` bounds its calls to the master (Mooncake's own: 30 s)."""
    master, metadata = parse_address(address)
    if timeout_s is not None:
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(int(timeout_s * 1000)))
        os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", str(int(timeout_s * 1000)))
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(
        host, metadata.rstrip("/") + "/metadata", segment_bytes, 16 << 20, "tcp", "", master
    )
    if code != 0:
        raise OSError(f"cannot join the Mooncake master at {master} (code {code})")
    return store
