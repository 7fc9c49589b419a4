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


def parse_cpu_list(text: str) -> list[int]:
    """'1', '2-5' or '0,2-3' (taskset's list form) -> the CPU numbers, sorted."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (e.g. '1', '2-5', '0,2-3')")
        cpus.update(range(int(first), int(last or first) + 1))
    return sorted(cpus)


def format_cpu_list(cpus: list[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def thread_ids() -> set[int]:
    """This process's threads, as the kernel numbers them."""
    return {int(task) for task in os.listdir("/proc/self/task")}


def pin_threads(tids: set[int], cpus: list[int]) -> None:
    """Runs these threads on `cpus` (Linux affinity is per thread; those started later inherit
    their creator's)."""
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that has just exited
            pass


def pin_process(cpus: list[int]) -> None:
    """Runs every thread of this process on `cpus`."""
    pin_threads(thread_ids(), cpus)


def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo("flags").split())


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: the CPU multiplies bf16 in hardware."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def describe_cpu() -> str:
    """e.g. 'Intel(R) Xeon(R) Processor (x86_64; avx2 fma avx512f avx512_bf16 amx_bf16)'."""
    flags = cpu_flags()
    return f"{cpu_model()} ({platform.machine()}; {' '.join(f for f in KEY_FLAGS if f in flags) or 'no AVX2'})"
