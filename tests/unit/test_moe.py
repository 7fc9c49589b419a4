"""Mixtures of experts: the configs' routing settings as each family writes them, every
supported architecture mapped to a model class, and the grouped dispatch equal to routing
each token on its own."""

from __future__ import annotations

import pytest
import torch

from engine.config import SUPPORTED_ARCHITECTURES, MoeConfig
from engine.layers.mlp import GatedMLP
from engine.layers.moe import MoE, linear_router, softmax_topk
from engine.models import model_class
from engine.models.deepseek_v3 import DeepseekV3Model
from engine.models.gemma3 import Gemma3Model
from engine.models.gpt_oss import GptOssModel
from engine.models.llama import LlamaModel
from engine.models.llama4 import Llama4Model
from engine.models.mixtral import MixtralModel
from engine.models.qwen3_moe import Qwen3MoeModel


def test_every_supported_architecture_has_a_model_class():
    classes = {arch: model_class(arch) for arch in SUPPORTED_ARCHITECTURES}
    assert classes == {
        "LlamaForCausalLM": LlamaModel,
        "MistralForCausalLM": LlamaModel,
        "Qwen2ForCausalLM": LlamaModel,
        "Qwen3ForCausalLM": LlamaModel,
        "Qwen3MoeForCausalLM": Qwen3MoeModel,
        "MixtralForCausalLM": MixtralModel,
        "DeepseekV3ForCausalLM": DeepseekV3Model,
        "Gemma3ForCausalLM": Gemma3Model,
        "GptOssForCausalLM": GptOssModel,
        "Llama4ForCausalLM": Llama4Model,
    }


def test_qwen3_moe_keeps_mlp_only_layers_and_the_steps_between_sparse_layers_dense():
    raw = {
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    moe = MoeConfig.from_dict(raw, "qwen3_moe", num_layers=6)
    assert moe == MoeConfig(16, 4, 32, False, (1, 5))  # norm_topk_prob defaults to off
    mixtral = MoeConfig.from_dict(
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64},
        "mixtral",
        num_layers=3,
    )
    assert mixtral == MoeConfig(8, 2, 64, True, (0, 1, 2))
    assert MoeConfig.from_dict(raw, "llama", num_layers=6) is None


def test_grouped_dispatch_equals_routing_each_token_alone():
    torch.manual_seed(0)
    hidden, inter, num_experts, top_k = 16, 24, 6, 2
    experts = [
        GatedMLP(torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter))
        for _ in range(num_experts)
    ]
    router = torch.randn(num_experts, hidden)
    x = torch.randn(11, hidden)
    for renormalize in (False, True):
        got = MoE(linear_router(router, top_k, renormalize), experts)(x)
        for t in range(x.shape[0]):
            weights, ids = softmax_topk(x[t : t + 1] @ router.T, top_k, renormalize)
            want = sum(
                w * experts[e](x[t : t + 1])[0]
                for w, e in zip(weights[0].tolist(), ids[0].tolist())
            )
            torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


def test_expert_parallelism_gives_each_rank_whole_experts_and_tensor_parallelism_a_slice_of_each():
    import dataclasses

    from engine.config import ModelConfig, RopeScaling
    from engine.errors import CheckpointError
    from engine.parallel.sharding import local_config

    moe = MoeConfig(8, 2, 48, True, (0, 1))
    mc = ModelConfig(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        384,
        64,
        160,
        2,
        4,
        2,
        32,
        512,
        1e-6,
        1e4,
        RopeScaling(),
        False,
        False,
        True,
        None,
        "float32",
        moe=moe,
    )
    ep = local_config(mc, 2, 1, expert_parallel=True).moe
    assert ep.local_experts == (4, 4) and ep.intermediate_size == 48
    assert [e for e in range(8) if ep.is_local(e)] == [4, 5, 6, 7]
    tp = local_config(mc, 2, 1).moe
    assert tp.local_experts is None and tp.intermediate_size == 24
    with pytest.raises(CheckpointError, match="does not divide the model's .*8 experts"):
        local_config(
            dataclasses.replace(mc, num_heads=3 * 4, num_kv_heads=3), 3, 0, expert_parallel=True
        )


def test_pipeline_stages_split_the_layers_by_their_cost():
    import dataclasses

    from engine.config import ModelConfig, RopeScaling
    from engine.parallel.sharding import stage_layers

    dense = ModelConfig(
        "LlamaForCausalLM",
        "llama",
        1000,
        64,
        256,
        8,
        4,
        4,
        16,
        512,
        1e-6,
        1e4,
        RopeScaling(),
        False,
        False,
        False,
        None,
        "float32",
    )
    assert [list(stage_layers(dense, 2, s)) for s in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [len(stage_layers(dense, 3, s)) for s in range(3)] == [3, 2, 3]
    # Layers 0-1 dense, 2-7 read 4 of 16 experts of width 256 (twice the dense MLP): the first
    # stage takes the cheap layers and more of them.
    moe = dataclasses.replace(dense, moe=MoeConfig(16, 4, 256, True, tuple(range(2, 8))))
    stages = [list(stage_layers(moe, 2, s)) for s in range(2)]
    assert stages[0] + stages[1] == list(range(8)) and len(stages[0]) > len(stages[1])
    assert [len(stage_layers(moe, 8, s)) for s in range(8)] == [1] * 8


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "fp8", "int4"])
def test_the_one_op_dispatch_is_the_same_bits_as_the_eager_one(kind):
    """engine/csrc/moe_experts.cpp against MoE's eager dispatch over the same packed weights:
    tokens that share experts, experts nobody chose, and experts another rank holds (expert
    parallelism: None here)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from engine.layers import fused
    from engine.layers.kernel_choice import invariant_kernels
    from engine.layers.quantized.fp8 import Fp8BlockWeight
    from engine.layers.quantized.int4 import Int4GroupWeight

    if not hasattr(fused.OPS, "moe_experts") or not invariant_kernels():
        pytest.skip("the one-op dispatch runs on the built batch-invariant kernels only")
    torch.manual_seed(7)
    hidden, inter, num_experts, top_k = 128, 128, 8, 3
    dtype = torch.float32 if kind == "float32" else torch.bfloat16

    def weight(out: int, cols: int):
        if kind == "fp8":
            values = (torch.randn(out, cols) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
            return Fp8BlockWeight(values, torch.rand(-(-out // 128), -(-cols // 128)) * 0.01, dtype)
        if kind == "int4":
            values = torch.randint(-8, 8, (out, cols), dtype=torch.int8)
            scales = (torch.rand(out, cols // 32) * 0.02).bfloat16()
            return Int4GroupWeight.from_checkpoint(
                "w", pack_to_int32(values, 4), scales, None, dtype
            )
        return (torch.randn(out, cols) * 0.1).to(dtype)

    experts = [
        None
        if e % 4 == 3
        else GatedMLP(weight(inter, hidden), weight(inter, hidden), weight(hidden, inter))
        for e in range(num_experts)
    ]
    moe = MoE(linear_router(torch.randn(num_experts, hidden).to(dtype), top_k, True), experts)
    assert moe.stacked is not None
    x = torch.randn(13, hidden).to(dtype)
    one_op = moe(x)
    moe.stacked = None
    assert torch.equal(one_op, moe(x))


def test_a_tokens_deepseek_routing_is_its_own_in_any_batch():
    """Sigmoid scores on the fused op: eager torch's took another exp for a tensor's last values
    and where a thread's share ends, so a token's weights changed in their last bits with its
    batch (first seen as a DeepSeek-V3 logprob off by an ulp under speculation)."""
    from engine.layers import fused
    from engine.layers.moe import grouped_sigmoid_topk

    if not hasattr(fused.OPS, "sigmoid"):
        pytest.skip("the fused ops are not built")
    torch.manual_seed(3)
    logits = torch.randn(1_001, 37)  # past one thread's share of an eager op, and a tail
    bias = torch.randn(37) * 0.1
    route = dict(top_k=4, num_groups=1, top_k_groups=1, renormalize=True, scaling_factor=2.5)
    weights, ids = grouped_sigmoid_topk(logits, bias, **route)
    for t in range(logits.shape[0]):
        alone = grouped_sigmoid_topk(logits[t : t + 1], bias, **route)
        assert torch.equal(alone[1], ids[t : t + 1]) and torch.equal(
            alone[0], weights[t : t + 1]
        ), t
