"""EAGLE-3 heads as peers publish them, read into the engine's head (eagle3.py).

`LlamaForCausalLMEagle3` (also named `Eagle3LlamaForCausalLM`): SpecForge's, EAGLE's and
the Kimi K2 / K2.5 heads on the Hub. One Llama decoder layer, `midlayer.*`, whose attention
reads [input_layernorm(embedding), hidden_norm(feature)] (2 x hidden); `fc` fuses the target's
hidden states at `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`; else
vLLM's default, the inputs of layers 2, L/2 and L-3); `lm_head` covers `draft_vocab_size`
ids, and `d2t` holds each draft id's offset to the target's (target = draft + d2t[draft];
`t2d`, the inverse mask, is not needed). The layer ids are read as vLLM reads them: the
input of each layer, which is what the engine's aux_layers are. An `embed_tokens.weight` the
head carries replaces the target's, as in vLLM.

`Eagle3DeepseekV2ForCausalLM` (also `Eagle3DeepseekV3ForCausalLM`; NVIDIA's Kimi-K2.5 head):
the same head with a DeepSeek layer, multi-head latent attention over the 2 x hidden input
(`midlayer.self_attn.q_a_proj` ... `kv_b_proj`, `o_proj` as the target's layers name them,
its yarn RoPE on the rope part) and a dense MLP, as vLLM's deepseek_eagle3 reads it.
EAGLE-3.1's options are read for both layouts (lightseekorg's Kimi MLA heads have the last two):
`norm_before_residual` (the residual is the normed feature), `fc_norm` (`fc_norm.{i}.weight`: each
aux state normed before `fc`) and `norm_output` (the normed output fed back as the next feature).
"""

from __future__ import annotations

import json
import os

import torch

from engine.config import MlaConfig, ModelConfig, _rope_scaling
from engine.errors import CheckpointError
from engine.speculative.eagle3_config import HeadConfig

LLAMA = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MLA = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


def architecture(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            archs = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return None
    return next((a for a in archs if a in LLAMA + MLA), None)


def vllm_aux_layers(num_layers: int) -> tuple[int, int, int]:
    return (2, num_layers // 2, num_layers - 3)


def _mla(raw: dict, folder: str) -> MlaConfig:
    try:
        return MlaConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{folder}: an MLA EAGLE-3 head's config.json lacks or garbles {exc}"
        ) from None


def read(folder: str, target: ModelConfig):
    """(HeadConfig, weights in the engine head's names, the head's own embedding table or None)."""
    from engine.checkpoint import Checkpoint

    with open(os.path.join(folder, "config.json")) as f:
        raw = json.load(f)
    arch = architecture(folder)
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(
            f"{folder}: EAGLE-3 heads of {raw['num_hidden_layers']} layers are not supported (1)"
        )
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    aux = (
        raw.get("eagle_aux_hidden_state_layer_ids")
        or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        or vllm_aux_layers(target.num_layers)
    )
    rope = raw.get("rope_parameters") or {}
    max_positions = int(raw.get("max_position_embeddings") or target.max_position_embeddings)
    cfg = HeadConfig(
        hidden_size=hidden,
        target_vocab_size=int(raw.get("vocab_size") or target.vocab_size),
        draft_vocab_size=int(
            raw.get("draft_vocab_size") or raw.get("vocab_size") or target.vocab_size
        ),
        aux_layers=tuple(int(i) for i in aux),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope, folder, max_positions),
        mla=_mla(raw, folder) if arch in MLA else None,
        **{
            option: bool(raw.get(option, False))
            for option in ("norm_before_residual", "fc_norm", "norm_output")
        },
    )
    w = Checkpoint(folder).weights
    try:
        weights = {
            "fc.weight": w["fc.weight"],
            "norm.weight": w["norm.weight"],
            "lm_head.weight": w["lm_head.weight"],
            "embed_norm.weight": w["midlayer.input_layernorm.weight"],
            "hidden_norm.weight": w["midlayer.hidden_norm.weight"],
            "post_attention_norm.weight": w["midlayer.post_attention_layernorm.weight"],
            "gate_up_proj.weight": torch.cat(
                [w["midlayer.mlp.gate_proj.weight"], w["midlayer.mlp.up_proj.weight"]]
            ),
            "down_proj.weight": w["midlayer.mlp.down_proj.weight"],
        }
        if cfg.fc_norm:
            weights["fc_norm.weight"] = torch.stack(
                [w[f"fc_norm.{i}.weight"] for i in range(len(cfg.aux_layers))]
            )
        if (
            cfg.mla
        ):  # as the target's layers name theirs (LatentAttention checks them), scales included
            weights.update(
                {
                    name[len("midlayer.") :]: t
                    for name, t in w.items()
                    if name.startswith("midlayer.self_attn.")
                }
            )
        else:
            weights["qkv_proj.weight"] = torch.cat(
                [w[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"]
            )
            weights["o_proj.weight"] = w["midlayer.self_attn.o_proj.weight"]
    except KeyError as exc:
        raise CheckpointError(f"{folder}: EAGLE-3 head ({arch}) is missing weight {exc}") from None
    offsets = w.get("d2t")
    ids = torch.arange(cfg.draft_vocab_size)
    weights["d2t"] = ids if offsets is None else ids + offsets.long()
    if int(weights["d2t"].min()) < 0 or int(weights["d2t"].max()) >= cfg.target_vocab_size:
        raise CheckpointError(
            f"{folder}: EAGLE-3 head's d2t maps draft ids outside the target's vocabulary"
        )
    return cfg, weights, w.get("embed_tokens.weight")
