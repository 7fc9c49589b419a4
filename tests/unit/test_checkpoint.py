"""Config parsing and memory-mapped weights."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_weights
from engine.config import ModelConfig
from engine.errors import CheckpointError

BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
)


def test_old_style_rope_fields_are_read():
    cfg = ModelConfig.from_dict(
        {**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}}
    )
    assert cfg.rope_theta == 500000.0
    assert (cfg.rope_scaling.type, cfg.rope_scaling.factor) == ("linear", 4.0)
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4


def test_unknown_rope_scaling_is_refused():
    with pytest.raises(CheckpointError, match="unsupported rope scaling type 'longrope'"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})


def test_deepseek_yarn_is_read_as_published():
    # DeepSeek-V3's and Kimi K2's rope_scaling, as their config.json files carry it.
    cfg = ModelConfig.from_dict(
        {
            **BASE,
            "max_position_embeddings": 163840,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        }
    )
    scaling = cfg.rope_scaling
    assert (scaling.type, scaling.factor, scaling.original_max_position_embeddings) == (
        "yarn",
        40.0,
        4096,
    )
    assert scaling.softmax_mscale == pytest.approx((0.1 * __import__("math").log(40) + 1) ** 2)
    from engine.layers.rotary import attention_factor

    assert attention_factor(scaling) == 1.0  # mscale / mscale_all_dim
    # Without a factor, transformers takes max / original positions.
    bare = ModelConfig.from_dict(
        {
            **BASE,
            "max_position_embeddings": 8192,
            "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 2048},
        }
    )
    assert bare.rope_scaling.factor == 4.0 and attention_factor(bare.rope_scaling) == pytest.approx(
        0.1 * __import__("math").log(4) + 1
    )


def test_missing_field_is_named():
    fields = dict(BASE)
    del fields["hidden_size"]
    with pytest.raises(CheckpointError, match="hidden_size"):
        ModelConfig.from_dict(fields)


def test_weights_are_views_of_a_private_file_mapping(hf_checkpoint):
    model, folder = hf_checkpoint("llama")
    weights = load_weights(folder)
    name = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(weights[name], model.state_dict()[name])
    weights[name].zero_()  # copy-on-write: the file is untouched
    assert load_weights(folder)[name].abs().sum() > 0


def test_sharded_checkpoint_loads_every_shard(hf_checkpoint):
    model, folder = hf_checkpoint("mistral")
    weights = load_weights(folder)
    assert set(weights) == set(model.state_dict())


def test_kimi_k25_serves_its_nested_text_model_and_never_views_the_vision_weights(hf_checkpoint):
    from engine.checkpoint import Checkpoint

    _, folder = hf_checkpoint("kimi_k25")
    cfg = ModelConfig.from_folder(folder)
    assert (cfg.architecture, cfg.weight_prefix) == ("DeepseekV3ForCausalLM", "language_model.")
    assert cfg.rope_scaling.type == "yarn" and cfg.rope_scaling.factor == 64.0
    weights = Checkpoint(folder, cfg.weight_prefix).weights
    assert "model.embed_tokens.weight" in weights and "lm_head.weight" in weights
    assert not any(
        name.startswith(("vision_tower", "mm_projector", "language_model")) for name in weights
    )
    with pytest.raises(CheckpointError, match="without a text_config"):
        ModelConfig.from_dict({"architectures": ["KimiK25ForConditionalGeneration"]})


def test_quantization_other_than_the_published_formats_is_named_at_load():
    from bench.quantize import INT4_CONFIG

    with pytest.raises(CheckpointError, match="quantization 'awq' is not supported"):
        ModelConfig.from_dict({**BASE, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(CheckpointError, match=r"weight_block_size \[64, 64\] is not supported"):
        ModelConfig.from_dict(
            {**BASE, "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}
        )
    fp8 = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert (
        ModelConfig.from_dict({**BASE, "quantization_config": fp8}).num_layers
        == BASE["num_hidden_layers"]
    )
    assert (
        ModelConfig.from_dict({**BASE, "quantization_config": INT4_CONFIG}).num_layers
        == BASE["num_hidden_layers"]
    )
    group = INT4_CONFIG["config_groups"]["group_0"]
    for change, named in [
        ({"weights": {**group["weights"], "num_bits": 8}}, "'num_bits': 8"),
        ({"weights": {**group["weights"], "symmetric": False}}, "'symmetric': False"),
        ({"weights": {**group["weights"], "actorder": "group"}}, "'actorder': 'group'"),
        ({"input_activations": {"num_bits": 8, "type": "int"}}, "input_activations"),
        ({"format": "marlin-24"}, "format 'marlin-24'"),
    ]:
        config = {**INT4_CONFIG, "config_groups": {"group_0": {**group, **change}}}
        with pytest.raises(
            CheckpointError, match="compressed-tensors group 'group_0'.*is not supported"
        ) as refused:
            ModelConfig.from_dict({**BASE, "quantization_config": config})
        assert named in str(refused.value)
    with pytest.raises(CheckpointError, match="without config_groups"):
        ModelConfig.from_dict(
            {**BASE, "quantization_config": {"quant_method": "compressed-tensors"}}
        )


def test_int4_experts_stay_packed_and_a_tensor_parallel_rank_reads_only_its_share(
    hf_checkpoint, monkeypatch
):
    """Kimi K2.5's routed experts as compressed-tensors packs them: the Linear keeps int32 words
    (half a byte a weight, no dense copy) and computes the dequantized product; a rank of two
    holds half the rows (gate, up) or half the groups (down) of the packed words and scales."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    from engine.checkpoint import Checkpoint
    from engine.layers.linear import Linear
    from engine.layers.quantized.int4 import Int4GroupWeight
    from engine.models.llama import WeightSource

    # the kernel that keeps them packed (others dequantize)
    monkeypatch.setenv("TANDEM_KERNELS", "invariant")
    _, folder = hf_checkpoint("kimi_k25")
    weights = Checkpoint(folder, ModelConfig.from_folder(folder).weight_prefix).weights
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # [64, 64]: two groups of 32 a row
    assert name not in weights and weights[name + "_packed"].shape == (64, 8)
    assert weights[name + "_scale"].dtype == torch.bfloat16 and weights[name + "_scale"].shape == (
        64,
        2,
    )
    whole = WeightSource(weights, torch.float32, torch.device("cpu")).get(name, (64, 64))
    assert isinstance(whole, Int4GroupWeight)
    assert torch.equal(
        whole.values(), unpack_from_int32(weights[name + "_packed"], 4, torch.Size([64, 64]))
    )
    linear = Linear(whole)
    assert linear.weight is None and linear.packed.dtype == torch.int32
    x = torch.randn(5, 64)
    torch.testing.assert_close(linear(x), x @ whole.dequantize().T, rtol=1e-5, atol=1e-5)
    for rank in (0, 1):
        share = WeightSource(weights, torch.float32, torch.device("cpu"), shard=(rank, 2))
        down = share.cols(name, (64, 32))
        gate = share.rows(name.replace("down", "gate"), (32, 64))
        assert isinstance(down, Int4GroupWeight) and isinstance(gate, Int4GroupWeight)
        assert (
            down.packed.shape == (64, 16)
            and down.scale.shape == (64, 1)
            and gate.packed.shape == (32, 32)
        )
        assert torch.equal(down.dequantize(), whole.dequantize()[:, rank * 32 : (rank + 1) * 32])
        assert share.num_bytes == down.nbytes + gate.nbytes


def test_fp8_block_weights_stay_quantized_and_compute_their_dequantized_product(
    hf_checkpoint, monkeypatch
):
    import torch

    # the kernel that keeps them quantized (others dequantize)
    monkeypatch.setenv("TANDEM_KERNELS", "invariant")
    from engine.checkpoint import Checkpoint
    from engine.layers.linear import Linear
    from engine.layers.quantized.fp8 import Fp8BlockWeight

    _, folder = hf_checkpoint("deepseek_v3_fp8")
    weights = Checkpoint(folder).weights
    # [256, 192]: 2 x 2 blocks, the last columns partial
    name = "model.layers.0.mlp.gate_proj.weight"
    assert weights[name].dtype == torch.float8_e4m3fn and weights[name + "_scale_inv"].shape == (
        2,
        2,
    )
    weight = Fp8BlockWeight(weights[name], weights[name + "_scale_inv"], torch.float32)
    linear = Linear(weight)
    # one byte a weight, no dense copy
    assert linear.weight is None and linear.packed.dtype == torch.uint8
    x = torch.randn(5, 192)
    torch.testing.assert_close(linear(x), x @ weight.dequantize().T, rtol=1e-5, atol=1e-5)
    assert torch.equal(linear(x[3:4]), linear(x)[3:4])
