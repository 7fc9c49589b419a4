"""Config parsing and memory-mapped weights."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import load_weights
from engine.config import ModelConfig
from engine.errors import CheckpointError

BASE = dict(
    architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
    num_hidden_layers=1, num_attention_heads=2,
)


def test_old_style_rope_fields_are_read():
    cfg = ModelConfig.from_dict({**BASE, "rope_theta": 500000.0,
                                 "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert cfg.rope_theta == 500000.0
    assert (cfg.rope_scaling.type, cfg.rope_scaling.factor) == ("linear", 4.0)
    assert cfg.num_kv_heads == 2 and cfg.head_dim == 4


def test_unknown_rope_scaling_is_refused():
    with pytest.raises(CheckpointError, match="unsupported rope scaling type 'yarn'"):
        ModelConfig.from_dict({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


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
