"""gpt-oss (GptOssForCausalLM: gpt-oss-20b and -120b), as transformers' modeling_gpt_oss.py
computes it: the Llama-family layer (llama.py) with

- attention: q, k, v and o with biases; GQA (the published: 64 query heads over 8 KV heads);
  `layer_types` alternating sliding_attention (the last `sliding_window`, 128, tokens) and
  full_attention, each window its own backend (engine/attention/layer_windows.py); each head's
  learned sink logit joins its softmax, in the max and the sum, and weighs no value
  (AttentionBackend.forward's sinks); YaRN RoPE, factor 32 over 4096 original positions, theta
  150000, not truncated (engine/layers/rotary.py);
- a mixture of experts in every layer: a router with a bias, its top k logits (4) softmaxed among
  themselves (engine/layers/moe.py `topk_softmax`); each expert's gate_up (gate and up
  interleaved: gate j is row 2j, up j row 2j + 1) and down with biases and the clamped SwiGLU
  between them (engine/layers/mlp.py ClampedSwigluMLP);
- the experts as published: MXFP4 `*_blocks` and `*_scales` (engine/layers/quantized/mxfp4.py,
  kept 4-bit), or dense as transformers saves them ([experts, in, out]: x @ W).

Tensor parallelism splits the heads and their sinks, each expert's interleaved gate_up rows by
halves (a rank keeps its units' gate and up together), and down's columns to match (MXFP4 stays
4-bit where a rank's width is whole groups of 32); o_proj's and down's biases are added by the
first rank alone, as the ranks' partial sums add up. With expert parallelism a rank holds whole
experts and adds their biases.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.layers.linear import Linear
from engine.layers.mlp import ClampedSwigluMLP
from engine.layers.moe import MoE, topk_softmax
from engine.layers.quantized import Weight, narrow
from engine.layers.quantized.mxfp4 import Mxfp4Weight
from engine.layers.rotary import apply_rotary
from engine.models.llama import DecoderLayer, LlamaModel, WeightSource


class GptOssLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, w: WeightSource, i: int, attn: AttentionBackend, mlp):
        super().__init__(cfg, w, i, attn, mlp)
        p = f"model.layers.{i}.self_attn."
        self.sinks = w.rows(p + "sinks", (cfg.num_heads,)).float().contiguous()
        self.o_bias = w.get(p + "o_proj.bias", (cfg.hidden_size,)) if w.rank == 0 else None

    def attention(self, h: torch.Tensor, cos_sin, kv_layer, attn_meta) -> torch.Tensor:
        cfg = self.cfg
        # [T, heads + 2 * kv_heads, head_dim]: q and k heads rotated together
        qkv = self.qkv_proj(h).view(h.shape[0], -1, cfg.head_dim)
        num_qk = cfg.num_heads + cfg.num_kv_heads
        qk = apply_rotary(qkv[:, :num_qk], cos_sin)
        q, k, v = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], qkv[:, num_qk:]
        o = self.attn.forward(q, k, v, kv_layer, attn_meta, self.sinks)
        out = self.o_proj(o.reshape(o.shape[0], -1))
        return out if self.o_bias is None else out + self.o_bias


class GptOssModel(LlamaModel):
    def make_layer(self, cfg: ModelConfig, w: WeightSource, i: int, attn: AttentionBackend):
        return GptOssLayer(cfg, w, i, attn.layer(i), self.make_mlp(cfg, w, i))

    def make_mlp(self, cfg: ModelConfig, w: WeightSource, i: int) -> MoE:
        moe, p = cfg.moe, f"model.layers.{i}.mlp."
        router = Linear(
            w.get(p + "router.weight", (moe.num_experts, cfg.hidden_size)),
            w.get(p + "router.bias", (moe.num_experts,)),
        )
        return MoE(lambda x: topk_softmax(router(x), moe.top_k), experts(w, cfg, p + "experts."))


def experts(w: WeightSource, cfg: ModelConfig, prefix: str) -> list[ClampedSwigluMLP | None]:
    """Every expert of a layer from its stacked tensors: this rank's slice of each, or with
    expert parallelism its whole ones (None for the others')."""
    moe, d = cfg.moe, cfg.hidden_size
    whole = moe.local_experts is not None
    width = moe.intermediate_size  # this rank's share of an expert's
    full = width * (1 if whole else w.ranks)  # as stored
    first = 0 if whole else w.rank * width
    gate_up = _stacked(w, prefix + "gate_up_proj", moe.num_experts, 2 * full, d)
    down = _stacked(w, prefix + "down_proj", moe.num_experts, d, full)
    gate_up_bias = _tensor(w, prefix + "gate_up_proj_bias", (moe.num_experts, 2 * full))
    down_bias = _tensor(w, prefix + "down_proj_bias", (moe.num_experts, d))
    held = []
    for e in range(moe.num_experts):
        if not moe.is_local(e):
            held.append(None)
            continue
        rows = slice(2 * first, 2 * (first + width))  # this rank's units, gate and up interleaved
        down_e = down(e) if whole else narrow(down(e), 1, first, width)
        held.append(
            ClampedSwigluMLP(
                _held(w, narrow(gate_up(e), 0, rows.start, 2 * width)),
                _held(w, gate_up_bias[e, rows]),
                _held(w, down_e),
                # the ranks' partial sums add up: one adds the bias
                _held(w, down_bias[e]) if whole or w.rank == 0 else None,
                moe.swiglu_alpha,
                moe.swiglu_limit,
            )
        )
    return held


def _stacked(w: WeightSource, name: str, experts: int, out: int, cols: int):
    """Expert e's [out, cols] weight, e -> weight: MXFP4 `name`_blocks [experts, out, cols / 32,
    16] with `name`_scales, or dense `name` [experts, cols, out] (x @ W), turned (a view)."""
    if name + "_blocks" in w.weights:
        stack = Mxfp4Weight.from_checkpoint(
            name, w.weights[name + "_blocks"], _tensor(w, name + "_scales", None), w.dtype
        )
        if tuple(stack.blocks.shape) != (experts, out, cols // 32, 16):
            raise CheckpointError(
                f"weight {name + '_blocks'!r} has shape {tuple(stack.blocks.shape)}, config "
                f"implies {(experts, out, cols // 32, 16)}"
            )
        return stack.expert
    dense = _tensor(w, name, (experts, cols, out))
    return lambda e: dense[e].t()


def _tensor(w: WeightSource, name: str, shape: tuple[int, ...] | None) -> torch.Tensor:
    tensor = w.weights.get(name)
    if tensor is None:
        raise CheckpointError(f"checkpoint is missing weight {name!r}")
    if shape is not None and tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, config implies {shape}"
        )
    return tensor


def _held(w: WeightSource, weight: Weight) -> Weight:
    """`weight` on this rank's device, in its dtype (MXFP4 as it is), counted."""
    if isinstance(weight, Mxfp4Weight):
        w.num_bytes += weight.nbytes
        return weight.to(w.device)
    w.num_bytes += weight.numel() * w.dtype.itemsize
    return weight.to(device=w.device, dtype=w.dtype).contiguous()
