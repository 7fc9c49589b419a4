"""What CPU this is (no torch import: benchmarks' parent processes read it too)."""

from __future__ import annotations

import functools
import os
import platform

# The instruction sets that decide which kernels are fast, in the order they are reported.
KEY_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@functools.cache
def _cpuinfo(field: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(field)), "")
    except OSError:
        return ""
    return line.split(":", 1)[1].strip() if line else ""


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def available_cpus() -> int:
    """The CPUs this process may run on (a container's or taskset's share, not the machine's)."""
    return len(os.sched_getaffinity(0))


def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo("flags").split())


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: the CPU multiplies bf16 in hardware."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def describe_cpu() -> str:
    """e.g. 'Intel(R) Xeon(R) Processor (x86_64; avx2 fma avx512f avx512_bf16 amx_bf16)'."""
    flags = cpu_flags()
    return f"{cpu_model()} ({platform.machine()}; {' '.join(f for f in KEY_FLAGS if f in flags) or 'no AVX2'})"
