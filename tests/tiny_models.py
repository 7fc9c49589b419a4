"""Tiny random models of each supported architecture, each exercising one family's quirks."""

from __future__ import annotations

import torch
import transformers

_COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,  # peakier logits than the default: fewer near-ties in greedy tests
)

ARCHITECTURES = {
    # Untied embeddings, GQA, llama3 rope scaling.
    "llama": dict(
        config=transformers.LlamaConfig,
        model=transformers.LlamaForCausalLM,
        kwargs=dict(rope_parameters=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=64,
                                         rope_theta=50000.0)),
    ),
    # Linear rope scaling; sharded checkpoint with an index file.
    "mistral": dict(
        config=transformers.MistralConfig,
        model=transformers.MistralForCausalLM,
        kwargs=dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0)),
        save=dict(max_shard_size="100KB"),
    ),
    # A sliding window shorter than the prompts, so the window mask is exercised.
    "mistral_window": dict(
        config=transformers.MistralConfig,
        model=transformers.MistralForCausalLM,
        kwargs=dict(sliding_window=8),
    ),
    # q/k/v bias, tied embeddings.
    "qwen2": dict(
        config=transformers.Qwen2Config,
        model=transformers.Qwen2ForCausalLM,
        kwargs=dict(tie_word_embeddings=True),
    ),
    # q/k RMSNorm, head_dim independent of hidden_size / heads.
    "qwen3": dict(
        config=transformers.Qwen3Config,
        model=transformers.Qwen3ForCausalLM,
        kwargs=dict(head_dim=32),
    ),
}


def build_hf_model(arch: str, seed: int = 0):
    spec = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = spec["config"](**_COMMON, **spec["kwargs"])
    config.architectures = [spec["model"].__name__]
    model = spec["model"](config).eval()
    # Random norms and biases too (HF initialises them to 1 and 0), so a missed one shows.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
    return model
