"""llama.cpp's tensor names (gguf-py's MODEL_TENSOR names) -> the Hugging Face names the engine's
models read (engine/models)."""

from __future__ import annotations

import re

TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# blk.N.<name> -> model.layers.N.<name>
BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    # deepseek2: multi-head latent attention (attn_k_b / attn_v_b: reader.py joins them)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    # deepseek2: the shared experts
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# Where an architecture's llama.cpp name means another Hugging Face one: gemma3's ffn_norm is
# the norm before the MLP, and it has norms after attention and after the MLP besides.
ARCH_BLOCK = {
    "gemma3": {
        "ffn_norm": "pre_feedforward_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
}
# blk.N.<name>.<kind> whose Hugging Face name is not <name>'s prefix and <kind>
WHOLE = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}  # deepseek2's router bias
# blk.N.<name> [experts, out, in] -> model.layers.N.mlp.experts.E.<name>
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}

_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(name: str, arch: str = "") -> str | None:
    """The engine's name of a GGUF tensor of an `arch` model, None for one it does not read
    (rope_freqs, ...); expert tensors are named by `expert_names`."""
    base, _, kind = name.rpartition(".")
    if base in TOP:
        return f"{TOP[base]}.{kind}"
    match = _BLOCK_NAME.match(name)
    if not match:
        return None
    layer, part, kind = match.groups()
    if f"{part}.{kind}" in WHOLE:
        return f"model.layers.{layer}.{WHOLE[f'{part}.{kind}']}"
    block = {**BLOCK, **ARCH_BLOCK.get(arch, {})}
    if part in block:
        return f"model.layers.{layer}.{block[part]}.{kind}"
    return None


def expert_names(name: str, num_experts: int) -> list[str] | None:
    """The engine's names of a stacked expert tensor's experts, in order; None if it is not one."""
    match = _BLOCK_NAME.match(name)
    if not match or match.group(2) not in EXPERTS:
        return None
    layer, part, kind = match.groups()
    return [
        f"model.layers.{layer}.mlp.experts.{e}.{EXPERTS[part]}.{kind}" for e in range(num_experts)
    ]


_SPLIT_KV_B = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight$")


def split_kv_b(name: str) -> tuple[str, str] | None:
    """(the engine's kv_b_proj name, "k" or "v") of a deepseek2 attn_k_b / attn_v_b tensor: a
    per-head half of kv_b_proj (engine/gguf/deepseek2.py); None for any other tensor."""
    match = _SPLIT_KV_B.match(name)
    if not match:
        return None
    return f"model.layers.{match.group(1)}.self_attn.kv_b_proj.weight", match.group(2)
