"""The machine's memory bandwidth, measured with torch, for the decode floor.

Decode at small batch streams every weight once per step, so the read bandwidth is what
bounds it: `sum` of a buffer far larger than the caches reads each byte once and writes
nothing. `copy` (read + write) is reported alongside as a sanity check.
"""

from __future__ import annotations

import json
import time

import torch


def measure_bandwidth(
    size_gib: float = 1.0, repeats: int = 5, threads: int | None = None
) -> dict[str, float]:
    """Best-of-`repeats` GB/s (1e9 bytes/s) for a read (sum) and a copy (read + write)."""
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        n = int(size_gib * 2**30) // 4
        src = torch.ones(n, dtype=torch.float32)  # ones, not empty: the pages must be real
        dst = torch.empty_like(src)
        dst.copy_(src)  # touch dst's pages outside the timed runs
        nbytes = n * 4
        read = copy = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            src.sum()
            read = max(read, nbytes / (time.perf_counter() - t))
            t = time.perf_counter()
            dst.copy_(src)
            copy = max(copy, 2 * nbytes / (time.perf_counter() - t))
        return {
            "read_gb_s": round(read / 1e9, 2),
            "copy_gb_s": round(copy / 1e9, 2),
            "threads": torch.get_num_threads(),
        }
    finally:
        torch.set_num_threads(old_threads)


if __name__ == "__main__":
    print(json.dumps(measure_bandwidth()))
