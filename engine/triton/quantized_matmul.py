"""y = x @ W.T with W kept as published and dequantized tile by tile inside the matmul (weight
only: x stays in the model's dtype), never a whole dense copy:

- FP8 blocks (engine/layers/quantized/fp8.py): e4m3 bytes, one fp32 scale a 128 x 128 block;
- INT4 groups (engine/layers/quantized/int4.py): two nibbles a byte (value + 8), one scale a
  group of inputs along a row.

A weight tile is dequantized in fp32 and rounded to x's dtype, as `dequantize()` rounds the
whole weight, so the products are those of the dense weight; the sums are fp32 (with few
rows, in parts along the inputs added in order after: a GPU has more SMs than such a matmul
has output tiles).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.quantized.fp8 import BLOCK as FP8_BLOCK
from engine.layers.quantized.fp8 import Fp8BlockWeight
from engine.layers.quantized.int4 import OFFSET as INT4_OFFSET
from engine.layers.quantized.int4 import Int4GroupWeight
from engine.triton import WIDEN_DOT_OPERANDS

INT4_BIAS: tl.constexpr = tl.constexpr(INT4_OFFSET)
BLOCK_N, BLOCK_K = 64, 128
# A batch-1 step's matmul has few output tiles (4096 rows: 64): cut along the inputs until
# there are about 4 programs an SM on an H100/H200 (132 SMs), so every SM streams weights.
TARGET_PROGRAMS = 512
MIN_INPUTS_A_SPLIT = 512


DENSE, FP8, INT4 = 0, 1, 2  # a weight's kind, for weight_tile


def weight_operands(weight) -> tuple[int, torch.Tensor, torch.Tensor, int]:
    """(kind, data, scales, group) of a weight as weight_tile reads it: FP8's bytes as uint8 with
    their block scales, INT4's packed bytes with their group scales, or a dense tensor (its
    scales a placeholder)."""
    if isinstance(weight, Int4GroupWeight):
        return INT4, weight.packed, weight.scale, weight.group
    if isinstance(weight, Fp8BlockWeight):
        return FP8, weight.weight.view(torch.uint8), weight.scale_inv, FP8_BLOCK
    return DENSE, weight, weight.new_zeros(1, 1), 1


@triton.jit
def weight_tile(
    w_ptr,
    s_ptr,
    n,
    k,
    inside,
    stride_wn,
    stride_sn,
    stride_sk,
    KIND: tl.constexpr,
    GROUP: tl.constexpr,
):
    """W's rows n, inputs k (a [BLOCK_N, BLOCK_K] tile, `inside` the valid part) as values:
    fp32 for the quantized kinds, the weight's own dtype when dense."""
    if KIND == 2:  # INT4: the byte holding each weight, its nibble, its group's scale
        packed = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :] // 2, mask=inside, other=0)
        nibble = (packed.to(tl.int32) >> ((k[None, :] % 2) * 4)) & 0xF
        scale = tl.load(
            s_ptr + n[:, None] * stride_sn + (k[None, :] // GROUP) * stride_sk,
            mask=inside,
            other=0.0,
        )
        w = (nibble - INT4_BIAS).to(tl.float32) * scale.to(tl.float32)
    elif KIND == 1:  # FP8: e4m3 bytes, one scale a GROUP x GROUP block
        byte = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=inside, other=0)
        scale = tl.load(
            s_ptr + (n[:, None] // GROUP) * stride_sn + (k[None, :] // GROUP) * stride_sk,
            mask=inside,
            other=0.0,
        )
        w = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    else:
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=inside, other=0.0)
    return w


@triton.jit
def _quantized_matmul(
    x_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    rows,
    cols,
    inputs,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_sk,
    stride_ym,
    stride_ys,
    inputs_a_split,
    KIND: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = split * inputs_a_split
    for start in range(first, tl.minimum(first + inputs_a_split, inputs), BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + m[:, None] * stride_xm + k[None, :],
            mask=(m[:, None] < rows) & (k[None, :] < inputs),
            other=0.0,
        )
        inside = (n[:, None] < cols) & (k[None, :] < inputs)
        w = weight_tile(w_ptr, s_ptr, n, k, inside, stride_wn, stride_sn, stride_sk, KIND, GROUP)
        w = w.to(x.dtype)  # the dense weight's value, as dequantize() rounds it
        if WIDEN:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    tl.store(
        y_ptr + split * stride_ys + m[:, None] * stride_ym + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(m[:, None] < rows) & (n[None, :] < cols),
    )


def splits_for(tiles: int, inputs: int) -> int:
    """Parts the inputs are cut into so that a few rows' matmul still fills the GPU: about
    TARGET_PROGRAMS programs, each at least MIN_INPUTS_A_SPLIT inputs long."""
    return max(1, min(TARGET_PROGRAMS // tiles, inputs // MIN_INPUTS_A_SPLIT))


def quantized_matmul(
    x: torch.Tensor, weight: Fp8BlockWeight | Int4GroupWeight, splits: int | None = None
) -> torch.Tensor:
    """x [T, in] in the model's dtype -> [T, out]. `splits`: parts of the inputs summed apart (in
    fp32, then in order), by default from `splits_for`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, inputs = x.shape
    cols = weight.shape[0]
    kind, data, scale, group = weight_operands(weight)
    block_m = 16 if rows <= 16 else 64
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(cols, BLOCK_N)
    splits = splits or splits_for(tiles, inputs)
    a_split = triton.cdiv(triton.cdiv(inputs, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(inputs, a_split)
    y = (
        x.new_empty(rows, cols)
        if splits == 1
        else x.new_empty(splits, rows, cols, dtype=torch.float32)
    )
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, BLOCK_N), splits)
    _quantized_matmul[grid](
        x,
        data,
        scale,
        y,
        rows,
        cols,
        inputs,
        x.stride(0),
        data.stride(0),
        scale.stride(0),
        scale.stride(1),
        y.stride(-2),
        y.stride(0) if splits > 1 else 0,
        a_split,
        KIND=kind,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION="ieee" if x.dtype == torch.float32 or WIDEN_DOT_OPERANDS else "tf32",
        WIDEN=WIDEN_DOT_OPERANDS,
    )
    return y if splits == 1 else y.sum(0).to(x.dtype)
