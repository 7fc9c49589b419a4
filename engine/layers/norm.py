"""RMSNorm computed in fp32, as Hugging Face's Llama-family models do; the fused CPU op when
built (engine/layers/fused.py), a Triton kernel on CUDA, the same values in eager torch
otherwise."""

import torch

from engine.layers import fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and fused.usable(x):
        return fused.OPS.rms_norm(x, weight, eps)
    if fused.triton_usable(x) and x.is_contiguous():
        from engine.triton.fused_ops import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    # Written out rather than F.rms_norm: on CPU the fused op is ~7x slower for 512 rows.
    if x.dtype == torch.float32:
        return (x * torch.rsqrt((x * x).mean(-1, keepdim=True).add_(eps))).mul_(weight)
    # Upcast for the statistics, multiply by the weight in the model's dtype (HF's order).
    xf = x.float()
    return weight * (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True).add_(eps))).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)) in one pass where the fused op runs; x is kept."""
    if fused.usable(x) and residual.stride(-1) == 1:
        return fused.OPS.add_rms_norm(x, residual, weight, eps)
    if fused.triton_usable(x) and x.is_contiguous() and residual.is_contiguous():
        from engine.triton.fused_ops import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps, residual)
    x = x + residual
    return x, rms_norm(x, weight, eps)
