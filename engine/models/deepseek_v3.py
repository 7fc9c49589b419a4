"""DeepSeek-V3 (and Kimi-K2, the same architecture): multi-head latent attention and a mixture
of experts with grouped sigmoid routing, shared experts and the first layers dense.

**MLA, absorbed.** Each token's keys and values come from one latent: c = norm(kv_a(x)) of
kv_lora_rank numbers, plus a rope part k_pe of qk_rope_head_dim shared by every head. The
KV cache holds [c, rotated k_pe] per token: one entry of one "head" (ModelConfig.kv_layout),
no separate V. Head h's key is [W_UK_h c, k_pe] and its value W_UV_h c (kv_b_proj holds both
maps), so q_h . k = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe: the query is absorbed into the
latent's space, every head attends over the latent as one shared KV head, and W_UV_h maps
the attended latent back to the head's values. Nothing is decompressed per key, prefill or
decode. Elements per token and layer: kv_lora_rank + rope, against heads x (qk_head_dim +
v_head_dim) for the same model's keys and values per head (DeepSeek-V3: 512 + 64 = 576
against 128 x (192 + 128) = 40,960, 71x fewer; tests/unit/test_mla.py checks the layout).

On the CPU's batch-invariant kernels the attention layer is one op
(engine/csrc/latent_attention.cpp): the same ops in the same order, without the Python between
them (a decode step at batch 1 1.05x on a Kimi-shaped checkpoint).

Tensor parallelism splits the heads (q_b, kv_b by rows, o_proj by columns) and keeps the
latent whole on every rank, so each rank's cache holds every token's latent.

DeepSeek-V3's own checkpoints use yarn RoPE (engine/layers/rotary.py), whose mscale_all_dim
also multiplies the softmax scale (ModelConfig.attention_shape), as transformers' DeepSeek-V3 does.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from engine.attention.base import AttentionBackend
from engine.attention.invariant_backend import InvariantBackend
from engine.config import ModelConfig
from engine.layers import fused
from engine.layers.linear import Linear, PerHeadLinear
from engine.layers.moe import MoE, grouped_sigmoid_topk
from engine.layers.norm import add_rms_norm, rms_norm
from engine.layers.quantized import QUANTIZED, cat_rows, dense
from engine.layers.rotary import apply_rotary
from engine.models.llama import LlamaModel, WeightSource, dense_mlp, experts
from engine.parallel.group import all_reduce

LATENT_NORM_EPS = 1e-6  # the q and kv latents' norms keep their own eps, not the config's


class LatentAttention:
    def __init__(
        self,
        cfg: ModelConfig,
        w: WeightSource,
        p: str,
        attn: AttentionBackend,
        input_size: int | None = None,
    ):
        """Weights `p`q_a_proj.weight ...; `input_size`: x's width where it is not the hidden size
        (an MLA EAGLE-3 head reads [embedding, feature]: engine/speculative/eagle3.py)."""
        mla, h = cfg.mla, cfg.num_heads
        d, out = input_size or cfg.hidden_size, cfg.hidden_size
        self.cfg, self.mla, self.attn = cfg, mla, attn
        qk_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        kv_a = w.get(p + "kv_a_proj_with_mqa.weight", (mla.kv_lora_rank + mla.qk_rope_head_dim, d))
        self.qkv_a_proj = self.q_a_proj = self.kv_a_proj = None
        if mla.q_lora_rank:
            q_a = w.get(p + "q_a_proj.weight", (mla.q_lora_rank, d))
            # Both latents of x in one matmul (vLLM's fused_qkv_a_proj), where the join keeps
            # quantized weights quantized (FP8 blocks: q_lora_rank a whole number of them).
            joined = cat_rows([q_a, kv_a])
            if isinstance(joined, QUANTIZED) or not isinstance(q_a, QUANTIZED):
                self.qkv_a_proj = Linear(joined)
            else:
                self.q_a_proj, self.kv_a_proj = Linear(q_a), Linear(kv_a)
            self.q_a_norm = w.get(p + "q_a_layernorm.weight", (mla.q_lora_rank,))
            self.q_b_proj = Linear(w.rows(p + "q_b_proj.weight", (h * qk_dim, mla.q_lora_rank)))
        else:
            self.kv_a_proj, self.q_b_proj = (
                Linear(kv_a),
                Linear(w.rows(p + "q_proj.weight", (h * qk_dim, d))),
            )
        self.kv_a_norm = w.get(p + "kv_a_layernorm.weight", (mla.kv_lora_rank,))
        kv_b = dense(
            w.rows(
                p + "kv_b_proj.weight",
                (h * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
            )
        )
        kv_b = kv_b.view(h, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        # Per head: nope -> latent (absorbed into the query) and latent -> v.
        # [heads, latent, nope]
        self.w_uk = PerHeadLinear(kv_b[:, : mla.qk_nope_head_dim].transpose(1, 2))
        self.w_uv = PerHeadLinear(kv_b[:, mla.qk_nope_head_dim :])  # [heads, v, latent]
        self.o_proj = Linear(w.cols(p + "o_proj.weight", (out, h * mla.v_head_dim)))
        self.one_op = self._one_op()

    def _one_op(self) -> bool:
        """Whether the layer runs as one CPU op (engine/csrc/latent_attention.cpp): every matmul on
        the batch-invariant kernel, attention the invariant backend's."""
        linears = (self.qkv_a_proj, self.q_b_proj, self.o_proj)
        return (
            hasattr(fused.OPS, "latent_attention")
            and isinstance(self.attn, InvariantBackend)
            and all(lin is not None and lin.invariant_only for lin in linears)
            and self.w_uk.packed is not None
            and self.w_uv.packed is not None
        )

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the query's input: its latent normed, or x; kv_a(x))."""
        if self.qkv_a_proj is not None:
            q_kv = self.qkv_a_proj(x)
            rank = self.mla.q_lora_rank
            return rms_norm(q_kv[:, :rank], self.q_a_norm, LATENT_NORM_EPS), q_kv[:, rank:]
        q_in = (
            x
            if self.q_a_proj is None
            else rms_norm(self.q_a_proj(x), self.q_a_norm, LATENT_NORM_EPS)
        )
        return q_in, self.kv_a_proj(x)

    def __call__(self, x: torch.Tensor, cos_sin, kv_layer, attn_meta) -> torch.Tensor:
        mla, h = self.mla, self.cfg.num_heads
        if self.one_op and fused.usable(x):
            return fused.OPS.latent_attention(
                x,
                self.qkv_a_proj.packed,
                self.qkv_a_proj.quantized.get("scales"),
                self.q_a_norm,
                self.q_b_proj.packed,
                self.q_b_proj.quantized.get("scales"),
                self.kv_a_norm,
                self.w_uk.packed,
                self.w_uv.packed,
                self.o_proj.packed,
                self.o_proj.quantized.get("scales"),
                *cos_sin,
                mla.rope_interleave,
                LATENT_NORM_EPS,
                kv_layer,
                attn_meta.k_rows,
                attn_meta.block_tables,
                attn_meta.token_seq,
                attn_meta.token_pos,
                self.attn.sliding_window or 0,
                self.attn.scale,
                [
                    h,
                    mla.q_lora_rank,
                    mla.kv_lora_rank,
                    mla.qk_nope_head_dim,
                    mla.qk_rope_head_dim,
                    mla.v_head_dim,
                    self.o_proj.out_features,
                ],
            )
        q_in, kv = self._latents(x)
        q = self.q_b_proj(q_in).view(x.shape[0], h, -1)
        q_nope, q_pe = q[..., : mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim :]
        latent = rms_norm(kv[:, : mla.kv_lora_rank], self.kv_a_norm, LATENT_NORM_EPS)
        k_pe = kv[:, None, mla.kv_lora_rank :]
        # Interleaved rope pairs (x0, x1), (x2, x3), ... rotate as halves, in that order.
        q_pe, k_pe = (
            apply_rotary(t, cos_sin, interleaved=mla.rope_interleave) for t in (q_pe, k_pe)
        )
        q_latent = self.w_uk(q_nope)  # [T, heads, latent]
        query = torch.cat([q_latent, q_pe], dim=-1)
        # [T, 1, latent + rope]: what the cache keeps
        key = torch.cat([latent[:, None], k_pe], dim=-1)
        attended = self.attn.forward(query, key, None, kv_layer, attn_meta)  # [T, heads, latent]
        o = self.w_uv(attended)  # [T, heads, v]
        return self.o_proj(o.reshape(x.shape[0], -1))


class DeepseekV3Layer:
    def __init__(self, cfg: ModelConfig, w: WeightSource, i: int, attn: AttentionBackend, mlp):
        p = f"model.layers.{i}."
        self.eps = cfg.rms_norm_eps
        self.input_norm = w.get(p + "input_layernorm.weight", (cfg.hidden_size,))
        self.post_attn_norm = w.get(p + "post_attention_layernorm.weight", (cfg.hidden_size,))
        self.attention = LatentAttention(cfg, w, p + "self_attn.", attn)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos_sin, kv_layer, attn_meta) -> torch.Tensor:
        h = rms_norm(x, self.input_norm, self.eps)
        # Tensor parallelism: each rank's heads (and MLP slice or experts) give partial sums.
        x, h = add_rms_norm(
            x,
            all_reduce(self.attention(h, cos_sin, kv_layer, attn_meta)),
            self.post_attn_norm,
            self.eps,
        )
        return x + all_reduce(self.mlp(h))


class DeepseekV3Model(LlamaModel):
    """The Llama-family model's embedding, stages and head, with DeepSeek-V3's layers."""

    def make_layer(self, cfg: ModelConfig, w: WeightSource, i: int, attn: AttentionBackend):
        return DeepseekV3Layer(cfg, w, i, attn, self.make_mlp(cfg, w, i))

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        return cfg.mla.qk_rope_head_dim  # only the rope part of a head rotates

    def make_mlp(self, cfg: ModelConfig, w: WeightSource, i: int):
        moe, p = cfg.moe, f"model.layers.{i}.mlp."
        if i not in moe.sparse_layers:
            return super().make_mlp(cfg, w, i)
        routed = experts(w, cfg, p + "experts.")
        # Shared experts are split like a dense MLP (with expert parallelism too, whose routed
        # experts keep their whole width).
        width = (
            moe.intermediate_size
            * moe.num_shared_experts
            // (w.ranks if moe.local_experts is not None else 1)
        )
        shared: Optional = (
            dense_mlp(w, f"{p}shared_experts.", width, cfg.hidden_size)
            if moe.num_shared_experts
            else None
        )
        # The router and its bias in fp32, as DeepSeek keeps them, whatever the model's dtype.
        fp32 = WeightSource(w.weights, torch.float32, w.device)
        router = fp32.get(p + "gate.weight", (moe.num_experts, cfg.hidden_size))
        bias = fp32.get_optional(p + "gate.e_score_correction_bias", (moe.num_experts,))
        if bias is None:
            bias = torch.zeros(moe.num_experts, device=w.device)
        route = partial(
            _route,
            router=Linear(router),
            bias=bias,
            top_k=moe.top_k,
            num_groups=moe.num_groups,
            top_k_groups=moe.top_k_groups,
            renormalize=moe.renormalize,
            scaling_factor=moe.scaling_factor,
        )
        return MoE(route, routed, shared)


def _route(x: torch.Tensor, router: Linear, bias: torch.Tensor, **kwargs):
    return grouped_sigmoid_topk(router(x.float()), bias, **kwargs)
