"""Mixtures of experts: the configs' routing settings as each family writes them, every
supported architecture mapped to a model class, and the grouped dispatch equal to routing
each token on its own."""

from __future__ import annotations

import torch

from engine.config import SUPPORTED_ARCHITECTURES, MoeConfig
from engine.layers.mlp import GatedMLP
from engine.layers.moe import MoE, linear_router, softmax_topk
from engine.models import MODEL_CLASSES


def test_every_supported_architecture_has_a_model_class():
    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)


def test_qwen3_moe_keeps_mlp_only_layers_and_the_steps_between_sparse_layers_dense():
    raw = {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "decoder_sparse_step": 2,
           "mlp_only_layers": [3]}
    moe = MoeConfig.from_dict(raw, "qwen3_moe", num_layers=6)
    assert moe == MoeConfig(16, 4, 32, False, (1, 5))  # norm_topk_prob defaults to off
    mixtral = MoeConfig.from_dict({"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
                                  "mixtral", num_layers=3)
    assert mixtral == MoeConfig(8, 2, 64, True, (0, 1, 2))
    assert MoeConfig.from_dict(raw, "llama", num_layers=6) is None


def test_grouped_dispatch_equals_routing_each_token_alone():
    torch.manual_seed(0)
    hidden, inter, num_experts, top_k = 16, 24, 6, 2
    experts = [GatedMLP(torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter))
               for _ in range(num_experts)]
    router = torch.randn(num_experts, hidden)
    x = torch.randn(11, hidden)
    for renormalize in (False, True):
        got = MoE(linear_router(router, top_k, renormalize), experts)(x)
        for t in range(x.shape[0]):
            weights, ids = softmax_topk(x[t:t + 1] @ router.T, top_k, renormalize)
            want = sum(w * experts[e](x[t:t + 1])[0] for w, e in zip(weights[0].tolist(), ids[0].tolist()))
            torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)
