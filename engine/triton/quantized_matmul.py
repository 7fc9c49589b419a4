"""y = x @ W.T with W kept as published and dequantized tile by tile inside the matmul (weight
only: x stays in the model's dtype), never a whole dense copy:

- FP8 blocks (engine/layers/quantized/fp8.py): e4m3 bytes, one fp32 scale a 128 x 128 block;
- INT4 groups (engine/layers/quantized/int4.py): two nibbles a byte (value + 8), one scale a
  group of inputs along a row.

A weight tile is dequantized in fp32 and rounded to x's dtype, as `dequantize()` rounds the
whole weight, so the products are those of the dense weight; the sums are fp32.
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
    INT4: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, inputs, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + m[:, None] * stride_xm + k[None, :],
            mask=(m[:, None] < rows) & (k[None, :] < inputs),
            other=0.0,
        )
        inside = (n[:, None] < cols) & (k[None, :] < inputs)
        if INT4:
            packed = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :] // 2, mask=inside, other=0)
            nibble = (packed.to(tl.int32) >> ((k[None, :] % 2) * 4)) & 0xF
            scale = tl.load(
                s_ptr + n[:, None] * stride_sn + (k[None, :] // GROUP) * stride_sk,
                mask=inside,
                other=0.0,
            )
            w = (nibble - INT4_BIAS).to(tl.float32) * scale.to(tl.float32)
        else:
            byte = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=inside, other=0)
            scale = tl.load(
                s_ptr + (n[:, None] // GROUP) * stride_sn + (k[None, :] // GROUP) * stride_sk,
                mask=inside,
                other=0.0,
            )
            w = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        w = w.to(x.dtype)  # the dense weight's value, as dequantize() rounds it
        if WIDEN:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    tl.store(
        y_ptr + m[:, None] * stride_ym + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(m[:, None] < rows) & (n[None, :] < cols),
    )


def quantized_matmul(x: torch.Tensor, weight: Fp8BlockWeight | Int4GroupWeight) -> torch.Tensor:
    """x [T, in] in the model's dtype -> [T, out]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, inputs = x.shape
    cols = weight.shape[0]
    int4 = isinstance(weight, Int4GroupWeight)
    data, scale = (weight.packed, weight.scale) if int4 else (weight.weight, weight.scale_inv)
    if not int4:
        data = data.view(torch.uint8)
    y = x.new_empty(rows, cols)
    block_m = 16 if rows <= 16 else 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, 64))
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
        y.stride(0),
        INT4=int4,
        GROUP=weight.group if int4 else FP8_BLOCK,
        BLOCK_M=block_m,
        BLOCK_N=64,
        BLOCK_K=128,
        PRECISION="ieee" if x.dtype == torch.float32 or WIDEN_DOT_OPERANDS else "tf32",
        WIDEN=WIDEN_DOT_OPERANDS,
    )
    return y
