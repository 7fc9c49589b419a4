"""Llama 4's text config as transformers' configuration_llama4.py reads it (Llama4TextConfig),
the lists a published config may leave out filled as its __post_init__ fills them:

- `no_rope_layers`: 1 where a layer has RoPE; absent or empty, every `no_rope_layer_interval`-th
  (4) has none (layer i is NoPE where (i + 1) % interval == 0: 3, 7, ...);
- `layer_types`: "chunked_attention" for the RoPE layers where `attention_chunk_size` is set,
  else "full_attention" (what decides each layer's mask);
- `moe_layers`: absent, every `interleave_moe_layer_step`-th from step - 1 (Maverick: 1, 3, ...);
  the others dense, `intermediate_size_mlp` wide; an expert and the shared expert are
  `intermediate_size` wide.

The engine's fields: intermediate_size is the dense layers' width, moe_intermediate_size an
expert's, and `IropeConfig` the attention's (engine/models/llama4.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# Llama4TextConfig's defaults, where a published config leaves a field out
DEFAULTS = dict(
    intermediate_size=8192,
    intermediate_size_mlp=16384,
    num_local_experts=16,
    num_experts_per_tok=1,
    interleave_moe_layer_step=1,
    use_qk_norm=True,
    no_rope_layer_interval=4,
    attention_chunk_size=8192,
    attn_temperature_tuning=True,
    floor_scale=8192,
    attn_scale=0.1,
    rms_norm_eps=1e-5,
    head_dim=128,
    num_key_value_heads=8,
    max_position_embeddings=4096 * 32,
)
DEFAULT_THETA = 500000.0


@dataclass(frozen=True)
class IropeConfig:
    """RoPE in all but `nope_layers`; the `chunked_layers` attend within chunks of `chunk_size`
    tokens; q and k L2-normalised after RoPE where `qk_norm`; the NoPE layers' q scaled by
    log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1 where `temperature_tuning`."""

    nope_layers: tuple[int, ...]
    chunked_layers: tuple[int, ...]
    chunk_size: int | None
    qk_norm: bool
    temperature_tuning: bool
    floor_scale: float
    attn_scale: float

    @staticmethod
    def from_dict(raw: dict) -> IropeConfig:
        n = int(raw["num_hidden_layers"])
        interval = int(raw.get("no_rope_layer_interval") or 4)
        rope = list(raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)])
        chunk = raw.get("attention_chunk_size", DEFAULTS["attention_chunk_size"])
        types = raw.get("layer_types") or [
            "chunked_attention" if use and chunk is not None else "full_attention" for use in rope
        ]
        return IropeConfig(
            nope_layers=tuple(i for i in range(n) if not rope[i]),
            chunked_layers=tuple(i for i in range(n) if types[i] == "chunked_attention"),
            chunk_size=int(chunk) if chunk is not None else None,
            qk_norm=bool(raw.get("use_qk_norm", True)),
            temperature_tuning=bool(raw.get("attn_temperature_tuning", True)),
            floor_scale=float(raw.get("floor_scale", DEFAULTS["floor_scale"])),
            attn_scale=float(raw.get("attn_scale", DEFAULTS["attn_scale"])),
        )


def llama4_text(raw: dict) -> dict:
    """The text config with the engine's field names: the dense width as intermediate_size, an
    expert's as moe_intermediate_size, the MoE layers listed."""
    raw = {**DEFAULTS, **raw}
    n = int(raw["num_hidden_layers"])
    step = int(raw["interleave_moe_layer_step"])
    if not raw.get("rope_theta") and not (raw.get("rope_parameters") or {}).get("rope_theta"):
        raw["rope_theta"] = DEFAULT_THETA
    moe_layers = raw.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, n, step)) if step > 0 else []
    return {
        **raw,
        "intermediate_size": raw["intermediate_size_mlp"],
        "moe_intermediate_size": raw["intermediate_size"],
        "moe_layers": list(moe_layers),
    }
