"""Qwen3-MoE: the Qwen3 decoder with a mixture of experts in the sparse layers (softmax top-k
routing, renormalised when the config's `norm_topk_prob` says so; `mlp_only_layers` and
`decoder_sparse_step` keep some layers dense)."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.layers.moe import MoE, linear_router
from engine.models.llama import LlamaModel, WeightSource, experts


class Qwen3MoeModel(LlamaModel):
    def make_mlp(self, cfg: ModelConfig, w: WeightSource, i: int):
        moe, p = cfg.moe, f"model.layers.{i}.mlp."
        if i not in moe.sparse_layers:
            return super().make_mlp(cfg, w, i)
        router = w.get(p + "gate.weight", (moe.num_experts, cfg.hidden_size))
        return MoE(
            linear_router(router, moe.top_k, moe.renormalize), experts(w, cfg, p + "experts.")
        )
