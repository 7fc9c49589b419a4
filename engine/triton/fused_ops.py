"""The small ops of a layer, one Triton kernel each on CUDA, where eager torch launches several:
RMSNorm (with the residual added first), rotary embedding and the gated MLP's SiLU-and-multiply.
Inside a decode step's CUDA graph, at batch 1, each launch costs more than its work.

Each rounds where the eager op rounds (engine/layers/norm.py, rotary.py, mlp.py), computing in
fp32 between; the values match eager's to rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import engine.triton  # noqa: F401  (the interpreter without CUDA, before any kernel is defined)


@triton.jit
def _rms_norm(
    x_ptr,
    residual_ptr,
    sum_ptr,
    weight_ptr,
    out_ptr,
    cols,
    stride_x,
    stride_r,
    stride_s,
    stride_o,
    eps,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    inside = c < cols
    x = tl.load(x_ptr + row * stride_x + c, mask=inside, other=0.0)
    if ADD:  # x + residual, rounded to the model's dtype, is the next layer's residual
        residual = tl.load(residual_ptr + row * stride_r + c, mask=inside, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + c, x, mask=inside)
    xf = x.to(tl.float32)
    scale = tl.rsqrt(tl.sum(xf * xf, 0) / cols + eps)
    weight = tl.load(weight_ptr + c, mask=inside, other=0.0).to(tl.float32)
    normed = (xf * scale).to(x.dtype).to(tl.float32)  # rounded before the weight, as HF does
    tl.store(out_ptr + row * stride_o + c, (normed * weight).to(x.dtype), mask=inside)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., cols] normalized; with `residual`, (x + residual, its norm)."""
    cols = x.shape[-1]
    flat = x.reshape(-1, cols)
    out = torch.empty_like(flat)
    total = torch.empty_like(flat) if residual is not None else out
    res = residual.reshape(-1, cols) if residual is not None else flat
    _rms_norm[(flat.shape[0],)](
        flat,
        res,
        total,
        weight,
        out,
        cols,
        flat.stride(0),
        res.stride(0),
        total.stride(0),
        out.stride(0),
        eps,
        ADD=residual is not None,
        BLOCK=triton.next_power_of_2(cols),
    )
    out = out.view(x.shape)
    return out if residual is None else (total.view(x.shape), out)


@triton.jit
def _rotary(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_ot,
    stride_oh,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, HALF_PAD)
    inside = i < HALF
    if INTERLEAVED:  # pairs (x0, x1), (x2, x3), ... read as the halves [x0, x2, ...], [x1, x3, ...]
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, i + HALF
    src = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(src + first, mask=inside, other=0.0)
    x2 = tl.load(src + second, mask=inside, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_ct + i, mask=inside, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_ct + i, mask=inside, other=0.0).to(tl.float32)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    dst = out_ptr + t * stride_ot + h * stride_oh
    tl.store(dst + i, (x1 * cos - x2 * sin).to(dtype), mask=inside)
    tl.store(dst + HALF + i, (x2 * cos + x1 * sin).to(dtype), mask=inside)


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x [T, heads, head_dim] (last dim contiguous); cos, sin [T, 1, head_dim // 2]."""
    tokens, heads, head_dim = x.shape
    out = x.new_empty(x.shape)
    cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    _rotary[(tokens, heads)](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        out.stride(0),
        out.stride(1),
        HALF=head_dim // 2,
        HALF_PAD=triton.next_power_of_2(head_dim // 2),
        INTERLEAVED=interleaved,
    )
    return out


@triton.jit
def _silu_and_mul(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = col < width
    gate = tl.load(x_ptr + row * stride_x + col, mask=inside, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + col, mask=inside, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # silu, rounded as F.silu's
    tl.store(out_ptr + row * stride_o + col, (act * up).to(gate.dtype), mask=inside)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * width] (gate, then up) -> silu(gate) * up [T, width]."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, width)
    block = min(1024, triton.next_power_of_2(width))
    _silu_and_mul[(rows, triton.cdiv(width, block))](
        gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=block
    )
    return out
