"""Rotary position embeddings (NeoX layout: halves rotated), with linear and llama3 scaling."""

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
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling,
                 dtype: torch.dtype, device: torch.device):
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim // 2], in the model's dtype as HF casts cos/sin
        self.cos = freqs.cos().to(dtype=dtype, device=device)
        self.sin = freqs.sin().to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's positions [T]: [T, 1, head_dim // 2] each. Once per step."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [T, heads, head_dim] (q and k heads alike), rotated by each token's position."""
    cos, sin = cos_sin
    if fused.usable(x) and x.dim() == 3:
        return fused.OPS.rotary(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
