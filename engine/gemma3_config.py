"""Gemma 3's text config as ModelConfig.from_dict reads every family's: Gemma3TextConfig's
defaults filled in (Google's published text_config names only what differs from them), the
global layers' RoPE as the model's, and the per-layer fields (which layers slide, the sliding
layers' RoPE base, the softmax scale) under the names ModelConfig takes.

As transformers 5 reads it (models/gemma3/configuration_gemma3.py):
- `layer_types`, else one global layer in `sliding_window_pattern` (saved as
  `_sliding_window_pattern`; default 6): layer i is global where (i + 1) % pattern == 0;
- RoPE: `rope_parameters` {"full_attention": ..., "sliding_attention": ...}, or the older
  `rope_theta` (global, 1e6) with `rope_scaling` (global only) and `rope_local_base_freq` (10000);
- the softmax scale is query_pre_attn_scalar ** -0.5, not head_dim's.
"""

from __future__ import annotations

from engine.errors import CheckpointError

# Gemma3TextConfig's defaults (transformers 5.24), for the fields a published config may omit.
DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    max_position_embeddings=131_072,
    rms_norm_eps=1e-6,
    eos_token_id=1,
    tie_word_embeddings=True,
    query_pre_attn_scalar=256,
    sliding_window=4096,
    hidden_activation="gelu_pytorch_tanh",
)


def gemma3_text(raw: dict, where: str) -> dict:
    """`raw` with the defaults filled and `rope_theta` / `rope_scaling` the global layers', plus
    `sliding_layers`, `local_rope_theta` and `attention_scale`."""
    raw = {**DEFAULTS, **raw}
    if raw.get("attn_logit_softcapping"):
        raise CheckpointError(f"{where}: attn_logit_softcapping is not supported")
    if raw.get("use_bidirectional_attention"):
        raise CheckpointError(
            f"{where}: bidirectional attention (an embedding model) is not served"
        )
    if raw.get("hidden_activation") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(
            f"{where}: hidden_activation {raw.get('hidden_activation')!r} is not supported "
            "(gelu_pytorch_tanh)"
        )
    num_layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    if len(types) != num_layers:
        raise CheckpointError(f"{where}: {len(types)} layer_types for {num_layers} layers")
    params = raw.get("rope_parameters") or {}
    full = params.get("full_attention") or {}
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise CheckpointError(f"{where}: RoPE scaling on the sliding layers is not supported")
    scaling = {k: v for k, v in full.items() if k != "rope_theta"} or raw.get("rope_scaling") or {}
    return {
        **raw,
        "rope_theta": float(full.get("rope_theta") or raw.get("rope_theta") or 1e6),
        "rope_scaling": scaling,
        "rope_parameters": None,
        "local_rope_theta": float(
            local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0
        ),
        "sliding_layers": [i for i, t in enumerate(types) if t != "full_attention"],
        "attention_scale": float(raw["query_pre_attn_scalar"]) ** -0.5,
    }
