"""The KV store's configuration (flags generated from the fields: services/settings.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import psutil

from services import settings
from services.kvtransfer import TRANSPORTS


@dataclass(frozen=True)
class StoreConfig(settings.ServiceConfig):
    SERVICE = "kvcache"
    DESCRIPTION = "tandem KV cache store"
    metrics_port: int = field(
        default=0, metadata={"help": "Prometheus /metrics port; 0: any free port"}
    )
    kv_transport: str = field(
        default="ucx",
        metadata={
            "help": "how blocks move to and from workers",
            "env": "TANDEM_KV_TRANSPORT",
            "choices": TRANSPORTS,
        },
    )
    dram_bytes: int | None = field(
        default=None,
        metadata={
            "help": "DRAM tier size; unset: 25% of free memory",
            "env": "TANDEM_KV_STORE_DRAM_BYTES",
        },
    )
    disk_bytes: int = field(
        default=4 << 30,
        metadata={"help": "disk tier size (0: no disk tier)", "env": "TANDEM_KV_STORE_DISK_BYTES"},
    )
    disk_dir: str = field(
        default="build/kvcache",
        metadata={
            "help": "the disk tier's directory (kept across restarts)",
            "env": "TANDEM_KV_STORE_DIR",
        },
    )
    # 1, not Dynamo's 2: with DRAM the size of the workers' caches (issue 26's 256 MiB), a block
    # is mostly evicted before a second use, and the filter dropped what the disk was for
    # (bench/README.md: 0.67 -> 0.98 of the unlimited cache's hit ratio).
    disk_admission_uses: int = field(
        default=1,
        metadata={
            "help": "a block evicted from DRAM goes to disk once used this many times (1: every "
            "block; 2: stored, then read at least once)",
            "env": "TANDEM_KV_STORE_DISK_ADMISSION_USES",
        },
    )
    transfer_timeout_s: float = field(
        default=10.0, metadata={"help": "a Get's push to a worker, at most"}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.disk_bytes < 0 or (self.dram_bytes is not None and self.dram_bytes <= 0):
            raise ValueError("--dram-bytes must be positive and --disk-bytes not negative")
        if self.disk_admission_uses < 1:
            raise ValueError(
                f"--disk-admission-uses must be at least 1, not {self.disk_admission_uses}"
            )

    @property
    def dram_budget(self) -> int:
        return self.dram_bytes or int(psutil.virtual_memory().available * 0.25)
