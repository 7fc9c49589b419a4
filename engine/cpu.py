"""What CPU this is (no torch import: benchmarks' parent processes read it too)."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

log = logging.getLogger(__name__)

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


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit


@functools.cache
def keep_freed_memory() -> bool:
    """Has glibc keep the memory a step frees for the next step, instead of handing it back to the
    kernel and faulting it in again, zeroed, page by page: each step allocates its activations
    afresh (a 2,048-token wave of the demo model: a 12 MB MLP input a layer), and by default
    glibc maps such blocks anew each time and trims its heap as they are freed. Every block up to
    glibc's 32 MB ceiling then comes from the heap, which is never trimmed: the process keeps its
    high-water mark, as a serving engine's allocator does (the demo model's waves and a c64 loop
    in one engine, a 2-vCPU EPYC: 280-520k page faults -> 70k, kernel time 1.2-1.8 s -> 0.35 s,
    peak RSS 637 -> 647 MB). False where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and libc.mallopt(
            _M_TRIM_THRESHOLD, 2**31 - 1
        )
    except (OSError, AttributeError):
        done = False
    if not done:
        log.debug("mallopt unavailable: freed memory goes back to the kernel")
    return bool(done)
