"""The Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

Plain tensors rather than nn.Modules: weights are views of the memory-mapped checkpoint,
and the forward pass runs under inference mode only. Input is one flat batch of tokens from
every scheduled sequence; attention goes through the paged KV pool via the backend.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend
from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.layers.linear import linear
from engine.layers.norm import rms_norm
from engine.layers.rotary import RotaryEmbedding


class WeightSource:
    """Hands out checkpoint tensors by name, checked and converted to the engine's dtype."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device):
        self.weights = weights
        self.dtype = dtype
        self.device = device

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.weights.get(name)
        if tensor is None:
            raise CheckpointError(f"checkpoint is missing weight {name!r}")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"weight {name!r} has shape {tuple(tensor.shape)}, config implies {shape}")
        # A no-op (still the mmap view) when dtype and device already match.
        return tensor.to(device=self.device, dtype=self.dtype)

    def get_optional(self, name: str, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
        return self.get(name, shape) if name in self.weights else None


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: WeightSource, i: int, attn: AttentionBackend):
        p = f"model.layers.{i}."
        hd, h, kvh, d = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
        self.cfg = cfg
        self.attn = attn
        self.input_norm = w.get(p + "input_layernorm.weight", (d,))
        self.post_attn_norm = w.get(p + "post_attention_layernorm.weight", (d,))
        self.q_proj = w.get(p + "self_attn.q_proj.weight", (h * hd, d))
        self.k_proj = w.get(p + "self_attn.k_proj.weight", (kvh * hd, d))
        self.v_proj = w.get(p + "self_attn.v_proj.weight", (kvh * hd, d))
        self.o_proj = w.get(p + "self_attn.o_proj.weight", (d, h * hd))
        bias = w.get if cfg.attention_bias else w.get_optional
        self.q_bias = bias(p + "self_attn.q_proj.bias", (h * hd,))
        self.k_bias = bias(p + "self_attn.k_proj.bias", (kvh * hd,))
        self.v_bias = bias(p + "self_attn.v_proj.bias", (kvh * hd,))
        self.q_norm = w.get(p + "self_attn.q_norm.weight", (hd,)) if cfg.qk_norm else None
        self.k_norm = w.get(p + "self_attn.k_norm.weight", (hd,)) if cfg.qk_norm else None
        self.gate_proj = w.get(p + "mlp.gate_proj.weight", (cfg.intermediate_size, d))
        self.up_proj = w.get(p + "mlp.up_proj.weight", (cfg.intermediate_size, d))
        self.down_proj = w.get(p + "mlp.down_proj.weight", (d, cfg.intermediate_size))

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions, kv_layer, attn_meta) -> torch.Tensor:
        # x: [T, hidden]
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        h = rms_norm(x, self.input_norm, eps)
        q = linear(h, self.q_proj, self.q_bias).view(-1, cfg.num_heads, cfg.head_dim)
        k = linear(h, self.k_proj, self.k_bias).view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = linear(h, self.v_proj, self.v_bias).view(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, eps)
            k = rms_norm(k, self.k_norm, eps)
        q, k = rope(positions, q, k)
        o = self.attn.forward(q, k, v, kv_layer, attn_meta)
        x = x + linear(o.view(o.shape[0], -1), self.o_proj)
        h = rms_norm(x, self.post_attn_norm, eps)
        return x + linear(F.silu(linear(h, self.gate_proj)) * linear(h, self.up_proj), self.down_proj)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], attn: AttentionBackend,
                 dtype: torch.dtype, device: torch.device, max_positions: int):
        w = WeightSource(weights, dtype, device)
        self.cfg = cfg
        self.embed_tokens = w.get("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        self.layers = [DecoderLayer(cfg, w, i, attn) for i in range(cfg.num_layers)]
        self.norm = w.get("model.norm.weight", (cfg.hidden_size,))
        lm_head = w.get_optional("lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
        if lm_head is None and not cfg.tie_word_embeddings:
            raise CheckpointError("checkpoint is missing weight 'lm_head.weight' (embeddings are not tied)")
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else lm_head
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_pool: torch.Tensor, attn_meta) -> torch.Tensor:
        """input_ids, positions: [T]; kv_pool: [layers, blocks, 2, block_size, kv_heads, head_dim].
        Returns the final hidden states [T, hidden] (normed)."""
        x = F.embedding(input_ids, self.embed_tokens)
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, self.rope, positions, kv_pool[i], attn_meta)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Logits in fp32 whatever the model dtype: sampling and logprobs need the precision.
        return linear(hidden, self.lm_head).float()
