"""gemma3: how llama.cpp writes Gemma 3's text model (convert_hf_to_gguf.py's Gemma3Model),
served as Gemma3ForCausalLM (engine/models/gemma3.py).

transformers reads the config (its GGUF mapping: rope.freq_base as rope_theta, key_length as
head_dim, attention.sliding_window) and leaves the rest at Gemma3TextConfig's defaults; llama.cpp
(llama-model.cpp) reads these, and so does `config_fields`, into the companion config.json:
- one global layer in six (set_swa_pattern(6): no key), the window attention.sliding_window
  (absent where the converter saw sliding_window_pattern 1: every layer global);
- the sliding layers' RoPE base rope.freq_base_swa, else 10000, unscaled; the global layers'
  rope.freq_base with rope.scaling.type / factor (linear 8 on 4B and up: transformers drops it);
- the softmax scale: 1 / sqrt(head_dim), or 1 / sqrt(hidden / heads) for the 62-layer 27B
  (whose query_pre_attn_scalar is 168; transformers' GGUF config keeps its default, 256);
- final_logit_softcapping where the file has it.

Norm weights: the converter stores 1 + w (Gemma3RMSNorm multiplies by 1 + w); `hf_norm` gives
back w as transformers' GGUF loader does (Gemma2TensorProcessor: weights - 1, in fp32), and the
model adds the 1 again: the same bits as transformers (and as the stored value for w >= -0.5,
where the subtraction is exact).
"""

from __future__ import annotations

SWA_PATTERN = 6


def config_fields(reader, arch: str = "gemma3") -> dict:
    """config.json fields of a gemma3 file's metadata, over transformers' GGUF config."""

    def get(key: str, default=None):  # as reader.field (which imports names, not this module)
        value = reader.fields.get(f"{arch}.{key}")
        return default if value is None else value.contents()

    num_layers, hidden = int(get("block_count")), int(get("embedding_length"))
    head_dim = int(get("attention.key_length") or hidden // int(get("attention.head_count")))
    full = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 1e6))}
    kind, factor = get("rope.scaling.type"), get("rope.scaling.factor")
    if kind and kind != "none" and factor:
        full.update(rope_type=kind, factor=float(factor))
    window = get("attention.sliding_window")
    found = {
        "sliding_window": int(window) if window else None,
        "layer_types": [
            "full_attention" if (i + 1) % SWA_PATTERN == 0 else "sliding_attention"
            for i in range(num_layers)
        ],
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(get("rope.freq_base_swa", 10000.0)),
            },
        },
        "query_pre_attn_scalar": hidden // int(get("attention.head_count"))
        if num_layers == 62
        else head_dim,
    }
    cap = get("final_logit_softcapping")
    if cap:
        found["final_logit_softcapping"] = float(cap)
    return found


def hf_norm(weight):
    """A stored norm weight (1 + w, F32) as Hugging Face's w."""
    return weight.float() - 1.0
