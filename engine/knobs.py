"""The engine's process-wide environment knobs, each read here and nowhere else.

They decide how the process computes before any configuration exists (which ops library to
load, which matmul kernels), so they are not EngineConfig fields; EngineConfig's fields name
their own TANDEM_* variables beside their flags (services/settings.py), and the services'
configs do the same.

- TANDEM_KERNELS: invariant (default: batch-invariant kernels, the same bits in any batch),
  measured, remeasure, plain, onednn (engine/layers/kernel_choice.py).
- TANDEM_KERNEL_CACHE: the measured kernel choices' file (default ~/.cache/tandem/...).
- TANDEM_OPS_MARCH: which build of the CPU ops to load: native (default) or another -march
  target (tests load x86-64-v3, an AVX2-only CPU's build).
- TANDEM_FUSED=0: no CPU ops library at all (eager torch ops).
- TANDEM_CACHE_DIR: where GGUF models' companion folders are made (default ~/.cache/tandem).
"""

from __future__ import annotations

import os

KERNELS = ("invariant", "measured", "remeasure", "plain", "onednn")


def kernels() -> str:
    value = os.environ.get("TANDEM_KERNELS", "invariant")
    if value not in KERNELS:
        raise ValueError(f"TANDEM_KERNELS={value!r}: expected one of {', '.join(KERNELS)}")
    return value


def set_kernels(value: str) -> None:
    """For this process and the ranks it starts (the remeasure CLI)."""
    os.environ["TANDEM_KERNELS"] = value


def kernel_cache() -> str | None:
    return os.environ.get("TANDEM_KERNEL_CACHE") or None


def ops_march() -> str:
    return os.environ.get("TANDEM_OPS_MARCH", "native")


def fused_ops() -> bool:
    return os.environ.get("TANDEM_FUSED", "1") != "0"


def cache_root() -> str:
    return os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tandem"
    )
