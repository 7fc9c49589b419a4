"""Llama 4 (Llama4ForCausalLM, and Llama4ForConditionalGeneration's text model: Scout, Maverick),
the Llama-family layer (llama.py) with, as transformers' modeling_llama4.py computes it:

- iRoPE (ModelConfig.irope): RoPE, llama3-scaled, on complex-interleaved pairs (x0, x1), (x2,
  x3), ... in every layer but the NoPE ones (`no_rope_layers`: every fourth); the RoPE layers
  attend within chunks of `attention_chunk_size` (a token at pos sees keys pos - pos % chunk ..
  pos: engine/attention/layer_windows.py) and, where `use_qk_norm`, L2-normalise q and k after
  RoPE (an RMSNorm without weight, eps rms_norm_eps); the NoPE layers attend over everything,
  their q scaled by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1 (in fp32, rounded to
  the model's dtype) where `attn_temperature_tuning`. Interleaved RoPE hands back q and k in
  the halves' order ([x0, x2, ...], [x1, x3, ...]): both alike, so their products are unchanged.
- `feed_forward` in place of `mlp`: MoE layers (`moe_layers`, else every
  `interleave_moe_layer_step`-th) and dense ones `intermediate_size_mlp` wide. An MoE layer routes
  each token to its top-1 expert by a sigmoid of the top logit (fp32, rounded to the model's
  dtype), which scales the expert's input; a shared expert (`intermediate_size` wide, as an
  expert) is always added. The experts are stored fused, gate_up_proj [experts, hidden, 2 *
  width] (gate, then up, along the last axis) and down_proj [experts, width, hidden]: x @ W, the
  transpose of a Linear's weight; each expert is read out of them as its own gate/up and down.
- FP8 as FBGEMM computes it (quant_method fbgemm_fp8, engine/layers/quantized/fp8_channel.py):
  the converted Linears' float8 `weight` with `weight_scale` [out, 1], the experts' float8
  gate_up_proj and down_proj with `gate_up_proj_scale` [experts, 1, 2 * width] and
  `down_proj_scale` [experts, hidden, 1], one scale per output.
"""

from __future__ import annotations

from functools import partial

import torch

from engine.attention.base import AttentionBackend
from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.layers import fused
from engine.layers.linear import Linear
from engine.layers.mlp import GatedMLP
from engine.layers.moe import MoE
from engine.layers.norm import rms_norm
from engine.layers.quantized import Weight, narrow
from engine.layers.quantized.fp8_channel import Fp8ChannelWeight
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.llama import DecoderLayer, LlamaModel, WeightSource, dense_mlp


class _Step:
    """A step's positions as Llama 4's layers read them: RoPE's cos and sin, and the NoPE
    layers' q scale [T, 1, 1] fp32 (None without temperature tuning)."""

    def __init__(self, cos_sin: tuple, q_scale: torch.Tensor | None):
        self.cos_sin, self.q_scale = cos_sin, q_scale


class _Rope:
    def __init__(self, rope: RotaryEmbedding, cfg: ModelConfig):
        self.rope, self.irope = rope, cfg.irope

    def lookup(self, positions: torch.Tensor) -> _Step:
        q_scale = None
        if self.irope.temperature_tuning:
            floors = torch.floor((positions.float() + 1.0) / self.irope.floor_scale)
            q_scale = (torch.log1p(floors) * self.irope.attn_scale + 1.0)[:, None, None]
        return _Step(self.rope.lookup(positions), q_scale)


class Llama4Layer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, w: WeightSource, i: int, attn: AttentionBackend, mlp):
        super().__init__(cfg, w, i, attn, mlp)
        self.rotary = i not in cfg.irope.nope_layers
        self.l2_norm = (
            torch.ones(cfg.head_dim, dtype=w.dtype, device=w.device)
            if cfg.irope.qk_norm and self.rotary
            else None
        )
        self.temperature = cfg.irope.temperature_tuning and not self.rotary

    def attention(self, h: torch.Tensor, step: _Step, kv_layer, attn_meta) -> torch.Tensor:
        cfg = self.cfg
        # [T, heads + 2 * kv_heads, head_dim]: q and k heads are rotated and normed together.
        qkv = self.qkv_proj(h).view(h.shape[0], -1, cfg.head_dim)
        num_qk = cfg.num_heads + cfg.num_kv_heads
        qk, v = qkv[:, :num_qk], qkv[:, num_qk:]
        if self.rotary:
            qk = apply_rotary(qk, step.cos_sin, interleaved=True)
            if self.l2_norm is not None:  # every head's row its own: one [T * heads, head_dim] norm
                rows = qk.reshape(-1, cfg.head_dim)
                qk = rms_norm(rows, self.l2_norm, cfg.rms_norm_eps).view(qk.shape)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        if self.temperature:
            q = (q * step.q_scale).to(q.dtype)
        o = self.attn.forward(q, k, v, kv_layer, attn_meta)
        return self.o_proj(o.reshape(o.shape[0], -1))


class Llama4Model(LlamaModel):
    def make_layer(self, cfg: ModelConfig, w: WeightSource, i: int, attn: AttentionBackend):
        return Llama4Layer(cfg, w, i, attn.layer(i), self.make_mlp(cfg, w, i))

    def make_rope(self, cfg: ModelConfig, max_positions: int, dtype, device) -> _Rope:
        return _Rope(super().make_rope(cfg, max_positions, dtype, device), cfg)

    def make_mlp(self, cfg: ModelConfig, w: WeightSource, i: int):
        moe, p = cfg.moe, f"model.layers.{i}.feed_forward."
        if moe is None or i not in moe.sparse_layers:
            return dense_mlp(w, p, cfg.intermediate_size, cfg.hidden_size)
        # The shared expert is split like a dense MLP (with expert parallelism too, whose routed
        # experts keep their whole width).
        width = moe.intermediate_size // (w.ranks if moe.local_experts is not None else 1)
        shared = dense_mlp(w, p + "shared_expert.", width, cfg.hidden_size)
        router = Linear(w.get(p + "router.weight", (moe.num_experts, cfg.hidden_size)))
        route = partial(_route, router=router, top_k=moe.top_k)
        return MoE(route, fused_experts(w, cfg, p + "experts."), shared, scale_inputs=True)


def _route(x: torch.Tensor, router: Linear, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> (sigmoid of the top logits [T, k] fp32, rounded through the model's
    dtype as Llama4Router rounds them; expert ids [T, k])."""
    top, ids = router(x).topk(top_k, dim=-1)
    top = top.float().contiguous()
    # a token's scores its own (eager torch's sigmoid varies with where a thread's share ends)
    scores = fused.OPS.sigmoid(top) if fused.usable(top) else top.sigmoid()
    return scores.to(x.dtype).float(), ids


def fused_experts(w: WeightSource, cfg: ModelConfig, prefix: str) -> list[GatedMLP | None]:
    """Every expert of a layer from its fused tensors (`prefix`gate_up_proj, `prefix`down_proj):
    this rank's slice of each, or with expert parallelism its whole ones (None for the others')."""
    moe, d = cfg.moe, cfg.hidden_size
    whole = moe.local_experts is not None
    full = moe.intermediate_size * (1 if whole else w.ranks)  # an expert's width as stored
    gate_up = _stacked(w, prefix + "gate_up_proj", (moe.num_experts, d, 2 * full))
    down = _stacked(w, prefix + "down_proj", (moe.num_experts, full, d))
    part, first = (full, 0) if whole else (moe.intermediate_size, w.rank * moe.intermediate_size)
    experts = []
    for e in range(moe.num_experts):
        if not moe.is_local(e):
            experts.append(None)
            continue
        rows = _transposed(gate_up, e)  # [2 * full, hidden]: gate's rows, then up's
        gate, up = narrow(rows, 0, first, part), narrow(rows, 0, full + first, part)
        down_e = _transposed(down, e)  # [hidden, full]
        if not whole and w.ranks > 1:
            down_e = narrow(down_e, 1, first, part)
        experts.append(GatedMLP(*(_held(w, t) for t in (gate, up, down_e))))
    return experts


def _stacked(w: WeightSource, name: str, shape: tuple[int, ...]) -> Weight:
    """A fused tensor as stored (a view of the checkpoint), with its FP8 scales where it has them."""
    tensor = w.weights.get(name)
    if tensor is None:
        raise CheckpointError(f"checkpoint is missing weight {name!r}")
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, config implies {shape}"
        )
    scale = w.weights.get(name + "_scale")
    if scale is None:
        return tensor
    # gate_up's [experts, 1, out], down's [experts, out, 1]: one scale an output (x @ W's columns)
    outs = shape[2]
    if tensor.dtype != torch.float8_e4m3fn or scale.numel() != shape[0] * outs:
        raise CheckpointError(
            f"weight {name!r}: FBGEMM FP8 experts are float8_e4m3fn with one {name}_scale an "
            f"output, not {tensor.dtype} with {tuple(scale.shape)}"
        )
    return Fp8ChannelWeight(
        tensor, scale.float().reshape(shape[0], outs), w.dtype, w.activation_scale_ub
    )


def _transposed(stacked: Weight, e: int) -> Weight:
    """Expert e's [in, out] as a Linear's [out, in] (a view: copied once, where it is packed)."""
    if isinstance(stacked, Fp8ChannelWeight):
        return Fp8ChannelWeight(
            stacked.weight[e].t(), stacked.scale[e], stacked.dtype, stacked.activation_scale_ub
        )
    return stacked[e].t()


def _held(w: WeightSource, weight: Weight) -> Weight:
    """`weight` on this rank's device in its dtype (quantized weights as they are), counted."""
    if isinstance(weight, Fp8ChannelWeight):
        weight = Fp8ChannelWeight(
            weight.weight.contiguous(),
            weight.scale.contiguous(),
            weight.dtype,
            weight.activation_scale_ub,
            weight.split_inputs,
        )
        w.num_bytes += weight.nbytes
        return weight.to(w.device)
    w.num_bytes += weight.numel() * w.dtype.itemsize
    return weight.to(device=w.device, dtype=w.dtype).contiguous()
