"""Gemma 3's decoder (Gemma3ForCausalLM, and Gemma3ForConditionalGeneration's text model): the
Llama-family layer (llama.py) with, as transformers' modeling_gemma3.py computes it:
- RMSNorm weights stored as offsets: the norm multiplies by 1 + w, and computes in fp32 before
  rounding to the model's dtype (Llama rounds first, then multiplies);
- four norms a layer: before and after attention, before and after the MLP; q/k RMSNorm;
- a GELU (tanh) gated MLP; embeddings scaled by sqrt(hidden), rounded to the embedding's dtype;
- sliding-window layers (RoPE base local_rope_theta, unscaled) between global ones (rope_theta
  and its scaling), each window its own attention backend (engine/attention/layer_windows.py);
- the softmax scale query_pre_attn_scalar ** -0.5; final logit softcapping where the config sets
  it (Gemma 3's do not).
A GGUF file stores 1 + w (llama.cpp's converter adds it); engine/gguf/reader.py gives back w.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend
from engine.config import ModelConfig, RopeScaling
from engine.layers.mlp import GeluTanhMLP
from engine.layers.norm import rms_norm
from engine.layers.rotary import RotaryEmbedding
from engine.models.llama import DecoderLayer, LlamaModel, WeightSource
from engine.parallel.group import all_reduce


def scale_of(weight: torch.Tensor) -> torch.Tensor:
    """A Gemma norm's multiplier, 1 + w in fp32 (Gemma3RMSNorm's `1.0 + weight.float()`)."""
    return 1.0 + weight.float()


class Gemma3Layer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, w: WeightSource, i: int, attn: AttentionBackend, mlp):
        super().__init__(cfg, w, i, attn, mlp)
        p, d = f"model.layers.{i}.", cfg.hidden_size
        self.sliding = cfg.sliding_layers is not None and i in cfg.sliding_layers
        self.input_norm = scale_of(self.input_norm)
        self.post_attn_norm = scale_of(self.post_attn_norm)  # on attention's output
        self.pre_mlp_norm = scale_of(w.get(p + "pre_feedforward_layernorm.weight", (d,)))
        self.post_mlp_norm = scale_of(w.get(p + "post_feedforward_layernorm.weight", (d,)))
        self.qk_norm = scale_of(self.qk_norm)

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # fp32 throughout, one rounding to the model's dtype (a no-op in fp32)
        return rms_norm(x.float(), weight, self.cfg.rms_norm_eps).to(x.dtype)

    def forward(self, x: torch.Tensor, cos_sin, kv_layer, attn_meta) -> torch.Tensor:
        # x: [T, hidden]; cos_sin: (the global layers', the sliding layers')
        o = self.attention(
            self.norm(x, self.input_norm), cos_sin[self.sliding], kv_layer, attn_meta
        )
        x = x + self.norm(all_reduce(o), self.post_attn_norm)
        h = self.mlp(self.norm(x, self.pre_mlp_norm))
        return x + self.norm(all_reduce(h), self.post_mlp_norm)


class _TwoRopes:
    """The global layers' RoPE and the sliding layers': a step's positions looked up in both."""

    def __init__(self, full: RotaryEmbedding, sliding: RotaryEmbedding):
        self.full, self.sliding = full, sliding

    def lookup(self, positions: torch.Tensor) -> tuple:
        return self.full.lookup(positions), self.sliding.lookup(positions)


class Gemma3Model(LlamaModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.norm is not None:  # the last stage's
            self.norm = scale_of(self.norm)

    def make_layer(self, cfg: ModelConfig, w: WeightSource, i: int, attn: AttentionBackend):
        p = f"model.layers.{i}.mlp."
        f, d = cfg.intermediate_size, cfg.hidden_size
        mlp = GeluTanhMLP(
            w.rows(p + "gate_proj.weight", (f, d)),
            w.rows(p + "up_proj.weight", (f, d)),
            w.cols(p + "down_proj.weight", (d, f)),
        )
        return Gemma3Layer(cfg, w, i, attn.layer(i), mlp)

    def make_rope(self, cfg: ModelConfig, max_positions: int, dtype, device) -> _TwoRopes:
        full = super().make_rope(cfg, max_positions, dtype, device)
        if cfg.local_rope_theta is None:
            return _TwoRopes(full, full)
        sliding = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.local_rope_theta, RopeScaling(), dtype, device
        )
        return _TwoRopes(full, sliding)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x.float(), self.norm, self.cfg.rms_norm_eps).to(x.dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(input_ids)
        # Gemma3TextScaledWordEmbedding: sqrt(hidden) as an fp32 tensor, cast to x's dtype
        return x * torch.tensor(self.cfg.hidden_size**0.5).to(x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
