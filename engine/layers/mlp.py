"""The gated MLP of Llama-family layers: down(silu(gate(x)) * up(x)), gate and up fused into one
matmul; Gemma's with GELU (tanh form) in place of SiLU; gpt-oss's experts with biases and a
clamped SwiGLU on gate and up interleaved."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.layers import fused
from engine.layers.kernel_choice import invariant_linear_silu
from engine.layers.linear import Linear
from engine.layers.quantized import cat_rows


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * width] (gate, then up) -> silu(gate) * up: one Triton kernel on CUDA, one pass of
    engine/csrc/fused_ops.cpp on the CPU, whose bits are a row's own (eager torch's SiLU takes
    another exp for the values where a thread's share ends, so a row's bits depend on its batch)."""
    if fused.triton_usable(gate_up):
        from engine.triton.fused_ops import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(gate_up)
    if gate_up.dim() == 2 and fused.usable(gate_up):
        return fused.OPS.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one [T, width] allocation, not two


class GatedMLP:
    capturable = True  # nothing in it reads a device value on the host (engine/cuda_graphs.py)
    # added to gate_up's and down's outputs where a family has them (ClampedSwigluMLP)
    gate_up_bias = down_bias = None

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        """gate, up: [intermediate, hidden]; down: [hidden, intermediate]."""
        self.gate_up_proj = Linear(cat_rows([gate, up]))
        self.down_proj = Linear(down)
        # gate, up and SiLU in one op of the batch-invariant kernel, which needs a width that is
        # a multiple of 128 (up's blocks then start a whole panel on every build)
        self.fused = (
            self.gate_up_proj.invariant_only
            and gate.shape[0] % 128 == 0
            and hasattr(fused.OPS, "invariant_linear_silu")
        )

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up's output [T, 2 * width] -> down's input [T, width] (a mixture of experts
        calls it on its experts' rows together)."""
        return silu_and_mul(gate_up)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if self.fused and x.dim() == 2:  # gate, up and SiLU in one pass: no [T, 2 * width] between
            width, scales = gate_up.out_features // 2, gate_up.quantized.get("scales")
            return self.down_proj(invariant_linear_silu(x, gate_up.packed, width, scales))
        return self.down_proj(silu_and_mul(gate_up(x)))


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * width] (gate, then up) -> gelu_tanh(gate) * up, gelu computed in fp32 and rounded
    to the model's dtype as torch's is. 0.5 * (1 + tanh(z)) is sigmoid(2z), taken from the
    batch-invariant sigmoid: torch's tanh GELU takes a scalar tanh for the values past a row's
    last whole vector, so a row's bits depended on its batch (measured at width 1000). The CPU
    ops compute the same in one pass (eight passes over [T, width] took 13% of a long prompt)."""
    if gate_up.dim() == 2 and fused.usable(gate_up):
        return fused.OPS.gelu_tanh_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    g = gate.float()
    z = (g + 0.044715 * (g * g * g)) * (2 * math.sqrt(2 / math.pi))
    s = fused.OPS.sigmoid(z.contiguous()) if fused.usable(z) else torch.sigmoid(z)
    return (g * s).to(up.dtype) * up


class GeluTanhMLP(GatedMLP):
    """Gemma's MLP: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__(gate, up, down)
        self.fused = False  # the fused kernel's activation is SiLU

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(gate_up)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation, as transformers' GptOssExperts._apply_gate computes it: [T, 2 *
    width], gate and up interleaved (gate j in column 2j, up j in 2j + 1) -> (clamp(up, -limit,
    limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit). One pass of
    engine/csrc/fused_ops.cpp on the CPU, whose bits are a value's own; else eager torch."""
    if gate_up.dim() == 2 and fused.usable(gate_up) and hasattr(fused.OPS, "clamped_swiglu"):
        return fused.OPS.clamped_swiglu(gate_up, alpha, limit)
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwigluMLP(GatedMLP):
    """gpt-oss's expert: down(clamped_swiglu(gate_up(x) + gate_up_bias)) + down_bias, each bias
    added to its matmul's output (as transformers adds it: a bf16 output rounded, then summed)."""

    def __init__(
        self,
        gate_up: torch.Tensor,
        gate_up_bias: torch.Tensor | None,
        down: torch.Tensor,
        down_bias: torch.Tensor | None,
        alpha: float,
        limit: float,
    ):
        """gate_up: [2 * width, hidden], gate and up rows interleaved; down: [hidden, width]; the
        biases [2 * width] and [hidden], or None (a tensor-parallel rank but the first adds no
        down bias: the ranks' partial sums add up)."""
        self.gate_up_proj, self.down_proj = Linear(gate_up), Linear(down)
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias
        self.alpha, self.limit = alpha, limit
        self.fused = False  # the fused kernel's activation is SiLU on gate's and up's halves

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(gate_up, self.alpha, self.limit)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        h = h if self.gate_up_bias is None else h + self.gate_up_bias
        y = self.down_proj(self.activation(h))
        return y if self.down_bias is None else y + self.down_bias
