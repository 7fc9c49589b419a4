"""Gemma 3's pieces: its config as Google publishes it (a sparse text_config inside the
multimodal one), the GELU (tanh) activation batch-invariant and equal to torch's within
rounding, each layer attending through its window's backend, and a GGUF file's metadata read
as llama.cpp reads it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import create_backend
from engine.attention.layer_windows import LayerWindows
from engine.config import ModelConfig
from engine.gguf.gemma3 import config_fields
from engine.layers import fused
from engine.layers.mlp import gelu_tanh_and_mul

# google/gemma-3-4b-it's config.json (its vision_config shortened): the text_config names only
# what differs from Gemma3TextConfig's defaults.
PUBLISHED_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
}


def test_published_gemma3_4b_config_reads_as_transformers_defaults_fill_it():
    mc = ModelConfig.from_dict(PUBLISHED_4B)
    assert (mc.architecture, mc.weight_prefix, mc.torch_dtype) == (
        "Gemma3ForCausalLM",
        "language_model.",
        "bfloat16",
    )
    assert (mc.vocab_size, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (262_208, 8, 4, 256)
    assert mc.tie_word_embeddings and mc.qk_norm and mc.sliding_window == 1024
    # one global layer in six, the global layers' rope scaled, the sliding layers' base 1e4
    assert [i for i in range(34) if i not in mc.sliding_layers] == [5, 11, 17, 23, 29]
    assert (mc.rope_theta, mc.rope_scaling.type, mc.rope_scaling.factor) == (1e6, "linear", 8.0)
    assert mc.local_rope_theta == 10000.0
    assert mc.attention_scale == 256**-0.5


def test_gemma3_layer_types_and_rope_parameters_as_transformers_5_saves_them():
    mc = ModelConfig.from_dict(
        {
            "architectures": ["Gemma3ForCausalLM"],
            "num_hidden_layers": 3,
            "layer_types": ["full_attention", "sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 168,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 5e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
            },
        }
    )
    assert mc.sliding_layers == (1,)
    assert (mc.rope_theta, mc.rope_scaling.type, mc.local_rope_theta) == (5e5, "default", 2e4)
    assert mc.attention_scale == 168**-0.5


def test_gelu_tanh_is_a_rows_own_and_equals_torchs_within_rounding():
    torch.manual_seed(0)
    width = 500  # not a whole number of vectors: torch's own GELU differs in each row's tail
    gate_up = torch.randn(64, 2 * width) * 3
    together = gelu_tanh_and_mul(gate_up)
    for r in range(64):
        assert torch.equal(gelu_tanh_and_mul(gate_up[r : r + 1]), together[r : r + 1])
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(together, F.gelu(gate, approximate="tanh") * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_gelu_is_the_eager_ones_bits(dtype, monkeypatch):
    """engine/csrc's gelu_tanh_and_mul computes each op of the eager path in its order."""
    if fused.OPS is None:
        pytest.skip("the CPU ops are not built")
    torch.manual_seed(1)
    gate_up = (torch.randn(33, 2 * 300) * 4).to(dtype)  # a tail past the last whole vector
    ours = gelu_tanh_and_mul(gate_up)
    usable = fused.usable  # off for gate_up only: the eager path's sigmoid stays engine/csrc's
    monkeypatch.setattr(fused, "usable", lambda x: x.shape != gate_up.shape and usable(x))
    assert torch.equal(ours, gelu_tanh_and_mul(gate_up))


def test_each_layer_attends_through_its_windows_backend():
    shape = dict(
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        block_size=16,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    windows = create_backend("torch", sliding_window=4, sliding_layers=(0, 2), **shape)
    assert isinstance(windows, LayerWindows)
    assert [windows.layer(i).backend.sliding_window for i in range(3)] == [4, None, 4]
    # no window: every layer alike, one backend
    plain = create_backend("torch", sliding_window=None, sliding_layers=(0, 2), **shape)
    assert plain.layer(1) is plain and plain.sliding_window is None


class _Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


def _gguf_metadata(**values) -> object:
    reader = type("Reader", (), {})()
    reader.fields = {f"gemma3.{key}": _Field(value) for key, value in values.items()}
    return reader


def test_gguf_metadata_gives_llamacpps_layers_ropes_and_scale():
    # gemma-3-27b as llama.cpp's converter writes it: the global layers' linear rope scaling,
    # the softmax scale from hidden / heads (168), not key_length (128)
    fields = config_fields(
        _gguf_metadata(
            block_count=62,
            embedding_length=5376,
            **{
                "attention.head_count": 32,
                "attention.key_length": 128,
                "attention.sliding_window": 1024,
                "rope.freq_base": 1e6,
                "rope.scaling.type": "linear",
                "rope.scaling.factor": 8.0,
            },
        )
    )
    assert fields["query_pre_attn_scalar"] == 168 and fields["sliding_window"] == 1024
    assert fields["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert fields["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    mc = ModelConfig.from_dict(
        {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 62, **fields}
    )
    assert (mc.rope_scaling.type, mc.local_rope_theta) == ("linear", 10000.0)
    # gemma-3-1b: no scaling, the scale from its 256-wide heads, no window: every layer global
    small = config_fields(
        _gguf_metadata(
            block_count=26,
            embedding_length=1152,
            **{"attention.head_count": 4, "attention.key_length": 256},
        )
    )
    assert small["query_pre_attn_scalar"] == 256 and small["sliding_window"] is None
    assert small["rope_parameters"]["full_attention"] == {"rope_type": "default", "rope_theta": 1e6}
