"""Mixtral: the Mistral decoder with a mixture of experts in every layer (softmax top-k, always
renormalised), its weights under `block_sparse_moe` (w1 gate, w3 up, w2 down)."""

from __future__ import annotations

from engine.config import ModelConfig
from engine.layers.moe import MoE, linear_router
from engine.models.llama import LlamaModel, WeightSource, experts


class MixtralModel(LlamaModel):
    def make_mlp(self, cfg: ModelConfig, w: WeightSource, i: int):
        moe, p = cfg.moe, f"model.layers.{i}.block_sparse_moe."
        router = w.get(p + "gate.weight", (moe.num_experts, cfg.hidden_size))
        return MoE(
            linear_router(router, moe.top_k, moe.renormalize),
            experts(w, cfg, p + "experts.", ("w1", "w3", "w2")),
        )
