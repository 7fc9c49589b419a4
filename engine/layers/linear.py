"""Linear layers whose weights are prepared once, at load, for the fastest kernel at hand.

On CPU in fp32, weights are reordered into oneDNN's blocked layout and multiplied by oneDNN
(the kernels torch.compile's CPU backend uses): torch's default MKL path runs far below the
machine's bandwidth for one row and below its FLOPs for a few rows, and on AMD CPUs MKL
takes a generic code path. Elsewhere the plain torch matmul is used, with a detour for bf16
on CPUs that have no bf16 arithmetic.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

# oneDNN picks its blocked layout for an expected number of rows. Batch-1 decode is the
# bandwidth-bound case tandem optimises for; larger batches lose ~30% at 16 rows.
PACK_BATCH_HINT = 4


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: the CPU multiplies bf16 in hardware."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def emulated_bf16(x: torch.Tensor) -> bool:
    """True where bf16 math would be emulated: compute such matmuls in fp32 instead."""
    return x.dtype is torch.bfloat16 and x.device.type == "cpu" and not cpu_has_native_bf16()


def _onednn_pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    if weight.device.type != "cpu" or weight.dtype is not torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
    except (RuntimeError, AttributeError):  # a torch build without these ops: plain matmul
        return None


class Linear:
    """y = x @ weight.T + bias, for x: [T, in] and weight: [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, prepack: bool = True):
        """`prepack=False`: torch's plain matmul, for weights of a few hundred KB (an EAGLE-3
        head's), where oneDNN's per-call cost is 2-3x torch's (measured on an Intel Xeon)."""
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = _onednn_pack(weight) if prepack else None
        # Keep the plain weight only when it is what we multiply by (it may be an mmap view).
        self.weight = weight if self.packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if x.shape[0] > 1 and emulated_bf16(x):
            # ~3x faster than torch's emulated bf16 GEMM; one row stays bf16 (memory-bound).
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)
