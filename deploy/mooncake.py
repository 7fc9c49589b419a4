"""`KV_STORE=mooncake`: a `mooncake_master` (with its HTTP metadata server) and store nodes
(services/kvcache/mooncake_node.py), each contributing its DRAM, and its disk where it has
one, to the pool the workers read and write through (services/worker/mooncake_store.py).

The master is Mooncake's own binary, installed with the `mooncake-transfer-engine-non-cuda`
package beside this Python. It prints no ready line: it is ready once its RPC and metadata
ports accept connections.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from deploy.processes import ServiceFailed, free_port, start_service

MASTER_BINARY = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
STARTUP_TIMEOUT_S = 30.0
# With disk tiers: a block the master evicts from DRAM is written to its node's disk first
# (not every block at its put: eager offload lost blocks evicted before their write), and
# eviction starts at 80% of DRAM, a tenth at a time, not Mooncake's 90% and 5%: a block
# chosen keeps its DRAM until its node's next offload heartbeat, and puts arriving meanwhile
# are refused when DRAM is full (3,352 of 5,400 at 90%/5% with 2 x 16 MiB at 180 blocks/s;
# with 2 x 128 MiB, 1,038 of 16,200 at 90%/5%, 318 at 80%/10%).
OFFLOAD_FLAGS = (
    "--enable_offload=true",
    "--offload_on_evict=true",
    "--eviction_high_watermark_ratio=0.8",
    "--eviction_ratio=0.1",
)


@dataclass(frozen=True)
class Master:
    host: str
    rpc_port: int
    metadata_port: int
    metrics_port: int
    offload: bool = False  # the nodes have disk tiers: evicted blocks go to their disks

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://{self.host}:{self.metadata_port}"

    @property
    def kv_store(self) -> str:
        """What workers are given as `--kv-store`."""
        return f"mooncake://{self.address}?metadata={self.metadata}"

    def argv(self) -> list[str]:
        return [
            MASTER_BINARY,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            *(OFFLOAD_FLAGS if self.offload else ()),
        ]


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def start_master(
    master: Master | None = None, host: str = "127.0.0.1", stderr=None, offload: bool = False
):
    """Starts (or restarts, given the same `master`) a mooncake_master, for nodes with disk
    tiers if `offload`; returns the process and its `Master` once both its ports accept
    connections."""
    if not os.path.exists(MASTER_BINARY):
        raise ServiceFailed(
            f"KV_STORE=mooncake needs {MASTER_BINARY}: pip install -r requirements.txt "
            "(mooncake-transfer-engine-non-cuda)"
        )
    master = master or Master(host, free_port(), free_port(), free_port(), offload)
    proc = subprocess.Popen(
        master.argv(), stdout=stderr or subprocess.DEVNULL, stderr=stderr or subprocess.DEVNULL
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not (
        _accepts(master.host, master.rpc_port) and _accepts(master.host, master.metadata_port)
    ):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise ServiceFailed(f"mooncake_master failed to start (exit code {proc.poll()})")
        time.sleep(0.05)
    return proc, master


def start_node(
    master: Master, dram_bytes: int, stderr=None, disk_bytes: int = 0, disk_dir: str = ""
) -> tuple[subprocess.Popen, str]:
    """A store node of `dram_bytes`, and `disk_bytes` of disk in `disk_dir` (its own: Mooncake
    finds what it wrote before there); returns it and its transfer endpoint."""
    return start_service(
        "services.kvcache.mooncake_node",
        "--host",
        master.host,
        "--master",
        master.address,
        "--metadata",
        master.metadata,
        "--dram-bytes",
        str(dram_bytes),
        *(("--disk-bytes", str(disk_bytes), "--disk-dir", disk_dir) if disk_bytes else ()),
        stderr=stderr or subprocess.DEVNULL,
    )
