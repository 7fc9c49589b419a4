"""The gated MLP of Llama-family layers: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.linear import Linear
from engine.layers.quantized import cat_rows


class GatedMLP:
    capturable = True  # nothing in it reads a device value on the host (engine/cuda_graphs.py)

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        """gate, up: [intermediate, hidden]; down: [hidden, intermediate]."""
        self.gate_up_proj = Linear(cat_rows([gate, up]))
        self.down_proj = Linear(down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
