"""Rotary position embeddings (NeoX layout: halves rotated), with linear, llama3 and yarn scaling
(yarn as transformers computes it: DeepSeek-V3, Kimi K2, Qwen's long-context configs)."""

from __future__ import annotations

import math

import torch

from engine.config import RopeScaling
from engine.layers import fused


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    if scaling.type == "yarn":
        return _yarn_frequencies(head_dim, theta, scaling)
    return inv_freq


def _yarn_frequencies(dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Frequencies faster than beta_fast rotations over the original context are kept, those slower
    than beta_slow divided by `factor`, the band between ramped linearly."""

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    kept = 1 - ramp
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


def attention_factor(scaling: RopeScaling) -> float:
    """yarn's factor on cos and sin (1 for the other types)."""
    if scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return mscale(scaling.factor)


class RotaryEmbedding:
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: RopeScaling,
        dtype: torch.dtype,
        device: torch.device,
    ):
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim // 2], scaled in fp32 and cast to the model's dtype as HF does
        factor = attention_factor(scaling)
        self.cos = (freqs.cos() * factor).to(dtype=dtype, device=device)
        self.sin = (freqs.sin() * factor).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's positions [T]: [T, 1, head_dim // 2] each. Once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(
    x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], interleaved: bool = False
) -> torch.Tensor:
    """x: [T, heads, head_dim] (q and k heads alike), rotated by each token's position.
    `interleaved`: x's pairs are (x0, x1), (x2, x3), ... (DeepSeek's rope), read as the halves
    [x0, x2, ...] and [x1, x3, ...]: the result is in that order."""
    cos, sin = cos_sin
    if fused.usable(x) and x.dim() == 3:
        return fused.OPS.rotary(x, cos, sin, interleaved)
    if fused.triton_usable(x) and x.dim() == 3:
        from engine.triton.fused_ops import rotary

        return rotary(x, cos, sin, interleaved)
    if interleaved:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
