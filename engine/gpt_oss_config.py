"""gpt-oss's config as transformers' configuration_gpt_oss.py reads it (GptOssConfig), what a
published config leaves out filled as its __post_init__ fills it:

- `layer_types`: absent, sliding_attention for the even layers and full_attention for the odd
  ones; the sliding layers attend over the last `sliding_window` (128) tokens;
- RoPE: absent, YaRN with factor 32 over 4096 original positions, beta 32 / 1, not truncated,
  theta 150000 (openai/gpt-oss-20b and -120b publish these as rope_scaling and rope_theta);
- the experts: `num_local_experts` (`experts_per_token` is the published twin of
  `num_experts_per_tok`), `swiglu_limit` 7 and `swiglu_alpha` 1.702 (published configs leave
  alpha out).
"""

from __future__ import annotations

from engine.errors import CheckpointError

DEFAULTS = dict(
    num_hidden_layers=36,
    num_local_experts=128,
    num_experts_per_tok=4,
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    head_dim=64,
    num_attention_heads=64,
    num_key_value_heads=8,
    sliding_window=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    attention_bias=True,
    swiglu_limit=7.0,
    swiglu_alpha=1.702,
)
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = dict(
    rope_type="yarn",
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=4096,
)


def gpt_oss_text(raw: dict, where: str) -> dict:
    """`raw` with the defaults filled, plus `sliding_layers` (the engine's field)."""
    if "num_experts_per_tok" not in raw and raw.get("experts_per_token"):
        raw = {**raw, "num_experts_per_tok": raw["experts_per_token"]}
    raw = {**DEFAULTS, **raw}
    params = raw.get("rope_parameters") or {}
    if not raw.get("rope_scaling") and not params.get("rope_type"):
        raw["rope_scaling"] = DEFAULT_ROPE
    if not raw.get("rope_theta") and not params.get("rope_theta"):
        raw["rope_theta"] = DEFAULT_THETA
    n = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)
    ]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise CheckpointError(
            f"{where}: layer_types must be {n} of sliding_attention and full_attention"
        )
    return {**raw, "sliding_layers": [i for i, t in enumerate(types) if t == "sliding_attention"]}
