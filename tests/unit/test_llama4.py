"""Llama 4's config read as transformers reads it (the lists a config leaves out filled as
Llama4TextConfig fills them), its nested and FP8 layouts, and FBGEMM's FP8 Linear: the product
FBGEMM computes, a token's row its own in any batch, kept FP8 in memory."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.layers.linear import Linear
from engine.layers.quantized import cat_rows, narrow
from engine.layers.quantized.fp8_channel import Fp8ChannelWeight
from tests.llama4_models import fp8_rows

DERIVED = ("no_rope_layers", "layer_types", "moe_layers")


def published(**text) -> dict:
    """config.json as Meta publishes a Llama 4 (Llama4TextConfig's defaults are Scout's), the
    lists transformers derives left out."""
    reference = transformers.Llama4TextConfig(**text)
    # saved nested, a text_config names no architectures
    raw = {k: v for k, v in reference.to_dict().items() if k not in (*DERIVED, "architectures")}
    config = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": raw,
        "vision_config": {"hidden_size": 1408},
        "torch_dtype": "bfloat16",
    }
    return config, reference


@pytest.mark.parametrize(
    "text",
    [
        {},  # Scout: MoE in every layer, q/k norm
        {"interleave_moe_layer_step": 2, "use_qk_norm": False, "num_local_experts": 128},
    ],
    ids=["scout", "maverick"],
)
def test_layers_read_as_transformers_derives_them(text):
    raw, reference = published(**text)
    mc = ModelConfig.from_dict(raw)
    assert (mc.architecture, mc.weight_prefix, mc.torch_dtype) == (
        "Llama4ForCausalLM",
        "language_model.",
        "bfloat16",
    )
    rope = reference.no_rope_layers
    assert (
        mc.irope.nope_layers
        == tuple(i for i, r in enumerate(rope) if not r)
        == (3, 7, 11) + tuple(range(15, 48, 4))
    )
    assert mc.irope.chunked_layers == tuple(
        i for i, t in enumerate(reference.layer_types) if t == "chunked_attention"
    )
    assert mc.irope.chunk_size == 8192 and mc.irope.qk_norm == reference.use_qk_norm
    assert mc.moe.sparse_layers == tuple(reference.moe_layers)
    assert mc.moe.num_experts == reference.num_local_experts and mc.moe.top_k == 1
    assert mc.intermediate_size == reference.intermediate_size_mlp  # the dense layers'
    assert mc.moe.intermediate_size == reference.intermediate_size  # an expert's
    assert mc.rope_theta == 500000.0 and mc.head_dim == 128 and mc.num_kv_heads == 8
    # the lists as transformers saves them read the same
    lists = {k: v for k, v in reference.to_dict().items() if k in DERIVED}
    saved = dict(raw, text_config={**raw["text_config"], **lists, "architectures": None})
    assert ModelConfig.from_dict(saved).irope == mc.irope
    assert ModelConfig.from_dict(saved).moe == mc.moe


def test_fbgemm_fp8_is_read_and_an_unknown_quantization_is_named_in_one_line():
    raw, _ = published(interleave_moe_layer_step=2, use_qk_norm=False)
    raw["quantization_config"] = {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ["language_model.model.layers.0.self_attn", "vision_model"],
    }
    assert ModelConfig.from_dict(raw).activation_scale_ub == 1200.0
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with pytest.raises(CheckpointError) as refused:
        ModelConfig.from_dict(raw)
    assert "'awq' is not supported" in str(refused.value) and "\n" not in str(refused.value)


def fp8_weight(out: int, cols: int, ub: float | None = 3.0, seed: int = 0) -> Fp8ChannelWeight:
    torch.manual_seed(seed)
    q, scale = fp8_rows(torch.randn(out, cols))
    return Fp8ChannelWeight(q, scale, torch.float32, ub)


def fbgemm_product(x: torch.Tensor, weight: Fp8ChannelWeight) -> torch.Tensor:
    ub = None if weight.activation_scale_ub is None else torch.tensor(weight.activation_scale_ub)
    xq, x_scale = fp8_rows(x, ub)
    return (xq.float() @ weight.weight.float().T) * x_scale[:, None] * weight.scale[None, :]


@pytest.mark.parametrize("kernels", ["invariant", "measured"])
def test_the_product_is_fbgemms_and_a_rows_own(monkeypatch, kernels):
    monkeypatch.setenv("TANDEM_KERNELS", kernels)
    weight = fp8_weight(48, 300)
    linear = Linear(weight)
    x = torch.randn(9, 300) * 2  # some rows past the bound of 3
    y = linear(x)
    torch.testing.assert_close(y, fbgemm_product(x, weight), rtol=1e-5, atol=1e-5)
    if kernels == "invariant":
        assert linear.weight is None  # the packed FP8 bytes alone
        held = linear.packed.nbytes + linear.quantized["scales"].nbytes
        assert held + linear.rowwise.weight_scale.nbytes <= 1.15 * weight.nbytes
        for rows in (slice(0, 1), slice(3, 7)):
            assert torch.equal(linear(x[rows]), y[rows])


def test_slices_and_joins_stay_fp8():
    weight = fp8_weight(48, 64)
    dense = weight.dequantize()
    rows = narrow(weight, 0, 16, 16)
    assert isinstance(rows, Fp8ChannelWeight) and torch.equal(rows.dequantize(), dense[16:32])
    cols = narrow(weight, 1, 32, 32)
    assert cols.split_inputs and torch.equal(cols.dequantize(), dense[:, 32:])
    joined = cat_rows([weight, rows])
    assert isinstance(joined, Fp8ChannelWeight)
    assert torch.equal(joined.dequantize(), torch.cat([dense, dense[16:32]]))
