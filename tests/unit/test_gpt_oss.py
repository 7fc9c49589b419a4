"""gpt-oss's pieces against transformers': the published config as GptOssConfig fills it (layer
types, YaRN, the experts' settings), its RoPE tables, the experts' clamped SwiGLU, the one-op
dispatch of MXFP4 experts with biases equal to the eager one, and quantizations refused in one
line."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssRotaryEmbedding

from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.layers import fused
from engine.layers.mlp import ClampedSwigluMLP, clamped_swiglu
from engine.layers.moe import MoE, topk_softmax
from engine.layers.quantized.mxfp4 import Mxfp4Weight
from engine.layers.rotary import RotaryEmbedding

# openai/gpt-oss-20b's config.json, its 24 layer_types left to the default they equal
PUBLISHED_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 201088,
}


def test_the_published_config_reads_as_transformers_fills_it():
    mc = ModelConfig.from_dict(PUBLISHED_20B)
    hf = transformers.GptOssConfig(**PUBLISHED_20B)
    sliding = tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
    assert mc.sliding_layers == sliding == tuple(range(0, 24, 2)) and mc.sliding_window == 128
    assert (mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.attention_bias) == (64, 8, 64, True)
    moe = mc.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (32, 4, 2880)
    assert (moe.swiglu_limit, moe.swiglu_alpha) == (hf.swiglu_limit, hf.swiglu_alpha) == (7, 1.702)
    assert moe.sparse_layers == tuple(range(24)) and mc.attention_shape()["sinks"]
    scaling = mc.rope_scaling
    assert (scaling.type, scaling.factor, scaling.original_max_position_embeddings) == (
        "yarn",
        32.0,
        4096,
    )
    assert not scaling.truncate and mc.rope_theta == 150000
    # and the RoPE tables are transformers' (YaRN's ramp and attention factor)
    ours = RotaryEmbedding(64, 8192, mc.rope_theta, scaling, torch.float32, torch.device("cpu"))
    positions = torch.tensor([0, 1, 127, 4095, 8191])
    cos, sin = GptOssRotaryEmbedding(hf)(torch.zeros(1), positions[None])
    torch.testing.assert_close(ours.cos[positions], cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.sin[positions], sin[0], rtol=1e-6, atol=1e-6)


def test_quantizations_other_than_the_experts_mxfp4_are_refused_in_one_line():
    with pytest.raises(CheckpointError) as refused:
        ModelConfig.from_dict({**PUBLISHED_20B, "quantization_config": {"quant_method": "awq"}})
    assert "'awq' is not supported" in str(refused.value) and "\n" not in str(refused.value)
    llama = {
        **{k: PUBLISHED_20B[k] for k in ("hidden_size", "intermediate_size", "vocab_size")},
        "architectures": ["LlamaForCausalLM"],
        "num_attention_heads": 8,
        "num_hidden_layers": 2,
        "quantization_config": {"quant_method": "mxfp4"},
    }
    with pytest.raises(CheckpointError, match="mxfp4 quantization is read for gpt-oss's experts"):
        ModelConfig.from_dict(llama)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_clamped_swiglu_is_transformers_and_a_values_own(dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(37, 2 * 200) * 6).to(dtype)  # past the limit of 7 both ways
    config = transformers.GptOssConfig(num_local_experts=1)
    expected = GptOssExperts(config)._apply_gate(gate_up)
    ours = clamped_swiglu(gate_up, 1.702, 7.0)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype is torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ours, expected, **tol)
    for row in (0, 20, 36):
        assert torch.equal(clamped_swiglu(gate_up[row : row + 1], 1.702, 7.0), ours[row : row + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_op_dispatch_of_mxfp4_experts_with_biases_is_the_eager_ones_bits(dtype):
    """engine/csrc/moe_experts.cpp with gpt-oss's experts (MXFP4, biases, the clamped SwiGLU on
    gate and up interleaved) against MoE's eager dispatch: tokens sharing experts, experts
    nobody chose, experts another rank holds (None), one rank's experts without down biases."""
    from engine.layers.kernel_choice import invariant_kernels

    if not hasattr(fused.OPS, "moe_experts") or not invariant_kernels():
        pytest.skip("the one-op dispatch runs on the built batch-invariant kernels only")
    torch.manual_seed(8)
    hidden, width, num_experts, top_k = 64, 96, 8, 4

    def weight(out: int, cols: int) -> Mxfp4Weight:
        blocks = torch.randint(0, 256, (out, cols // 32, 16), dtype=torch.uint8)
        return Mxfp4Weight(
            blocks, torch.randint(120, 126, (out, cols // 32), dtype=torch.uint8), dtype
        )

    router = torch.randn(num_experts, hidden).to(dtype)
    for down_bias in (True, False):
        experts = [
            None
            if e % 4 == 3
            else ClampedSwigluMLP(
                weight(2 * width, hidden),
                torch.randn(2 * width).to(dtype),
                weight(hidden, width),
                torch.randn(hidden).to(dtype) if down_bias else None,
                1.702,
                7.0,
            )
            for e in range(num_experts)
        ]
        moe = MoE(lambda x: topk_softmax(x @ router.T, top_k), experts)
        assert moe.stacked is not None
        x = torch.randn(13, hidden).to(dtype)
        one_op = moe(x)
        moe.stacked = None
        assert torch.equal(one_op, moe(x))
