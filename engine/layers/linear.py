"""Linear layers, with a detour for bf16 on CPUs that have no bf16 arithmetic."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: the CPU multiplies bf16 in hardware (oneDNN uses it)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def emulated_bf16(x: torch.Tensor) -> bool:
    """True where bf16 math would be emulated: compute such matmuls in fp32 instead."""
    return x.dtype is torch.bfloat16 and x.device.type == "cpu" and not cpu_has_native_bf16()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, in], weight: [out, in]. With emulated bf16 and T > 1, an fp32 GEMM over an
    upcast copy of the weight runs ~3x faster than torch's bf16 GEMM; at T == 1 the bf16
    matrix-vector product is memory-bound and reads half the bytes, so it stays."""
    if x.shape[0] > 1 and emulated_bf16(x):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)
