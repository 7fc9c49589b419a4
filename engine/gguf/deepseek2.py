"""deepseek2: how llama.cpp writes DeepSeek-V3 and Kimi K2 (convert_hf_to_gguf.py's
DeepseekV2Model), served as Hugging Face's DeepseekV3ForCausalLM (engine/models/deepseek_v3.py).

transformers does not read this architecture from GGUF, so the config.json is built here from the
metadata (`<arch>.` keys below); the tokenizer still comes from transformers' GGUF converter,
which does not depend on the architecture (folder.py).
- block_count, embedding_length, feed_forward_length (the leading dense layers' MLP),
  context_length, attention.head_count, attention.layer_norm_rms_epsilon, rope.freq_base;
- MLA: attention.q_lora_rank (absent: a plain attn_q, as in V2-Lite), attention.kv_lora_rank,
  rope.dimension_count (qk_rope_head_dim). Newer files describe the absorbed form, one KV head
  of key_length = kv_lora_rank + rope and value_length = kv_lora_rank, and give the per-head
  widths as attention.key_length_mla (qk_nope + rope) and value_length_mla (v_head); older ones
  give those as key_length and value_length;
- experts: expert_count, expert_used_count, expert_shared_count, expert_feed_forward_length,
  leading_dense_block_count (first_k_dense_replace), expert_weights_scale (routed_scaling_factor,
  default 1), expert_weights_norm (norm_topk_prob, default false as llama.cpp reads it),
  expert_group_count / expert_group_used_count (n_group / topk_group, default 1: no groups),
  expert_gating_func: sigmoid (2) is served; softmax (1, or absent: DeepSeek-V2's files) is
  refused, since the engine's DeepSeek-V3 routing is sigmoid with the exp_probs_b bias;
- rope.scaling.{type, factor, original_context_length, yarn_beta_fast, yarn_beta_slow,
  yarn_attn_factor, yarn_log_multiplier}: llama.cpp keeps DeepSeek's mscale_all_dim as
  yarn_log_multiplier = 0.1 * mscale_all_dim and drops mscale, which every published DeepSeek
  and Kimi config sets equal to it (so mscale = mscale_all_dim here).

Layout: the converter permutes no rows; llama.cpp's "normal" rope rotates adjacent pairs, which
is DeepSeek's own interleaved rope part (rope_interleave). kv_b_proj [heads * (qk_nope + v_head),
kv_lora_rank] is either kept as attn_kv_b (older files) or split per head into attn_k_b
(heads, kv_lora_rank, qk_nope), stored transposed, and attn_v_b (heads, v_head, kv_lora_rank);
`join_kv_b` rebuilds it.
"""

from __future__ import annotations

import torch

from engine.errors import CheckpointError

SIGMOID = 2  # gguf-py's ExpertGatingFuncType


def hf_config(reader, path: str, arch: str = "deepseek2") -> dict:
    """The DeepseekV3 config.json of a deepseek2 file's metadata."""
    from transformers import DeepseekV3Config

    def field(key: str, default=None):  # as reader.field (which imports this module)
        value = reader.fields.get(key)
        return default if value is None else value.contents()

    def get(key: str, default=None):
        return field(f"{arch}.{key}", default)

    heads, rope = int(get("attention.head_count")), int(get("rope.dimension_count"))
    num_experts = int(get("expert_count", 0))
    gating = get("expert_gating_func")
    if num_experts and gating != SIGMOID:
        named = "softmax" if gating in (None, 1) else f"type {gating}"
        raise CheckpointError(
            f"{path}: deepseek2 with {named} expert gating (DeepSeek-V2) is not served; "
            "sigmoid-gated files (DeepSeek-V3, Kimi K2) are"
        )
    key_mla, value_mla = get("attention.key_length_mla"), get("attention.value_length_mla")
    embeddings = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embeddings is None:
        raise CheckpointError(f"{path}: deepseek2 file without token_embd.weight")
    rope_parameters = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    kind, factor = get("rope.scaling.type"), get("rope.scaling.factor")
    if kind == "yarn" and factor:
        # rounded: the multiplier is stored as f32 (0.1 comes back as 1.0000000149)
        mscale = round(float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
        rope_parameters.update(
            rope_type="yarn",
            factor=float(factor),
            original_max_position_embeddings=int(get("rope.scaling.original_context_length")),
            beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
            mscale=mscale,
            mscale_all_dim=mscale,
        )
        if get("rope.scaling.yarn_attn_factor") is not None:
            rope_parameters["attention_factor"] = float(get("rope.scaling.yarn_attn_factor"))
    elif kind not in (None, "none"):
        raise CheckpointError(f"{path}: deepseek2 rope scaling {kind!r} is not supported (yarn is)")
    q_lora_rank = get("attention.q_lora_rank")
    config = DeepseekV3Config(
        vocab_size=int(embeddings.shape[1]),  # ggml's shape: [hidden, vocab]
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        moe_intermediate_size=int(get("expert_feed_forward_length", 0)),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=int(get("expert_shared_count", 0)),
        n_routed_experts=num_experts,
        num_experts_per_tok=int(get("expert_used_count", 0)),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        n_group=int(get("expert_group_count", 1)),
        topk_group=int(get("expert_group_used_count", 1)),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        kv_lora_rank=int(get("attention.kv_lora_rank")),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=int(key_mla or get("attention.key_length")) - rope,
        v_head_dim=int(value_mla or get("attention.value_length")),
        max_position_embeddings=int(get("context_length")),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=rope_parameters,
        rope_interleave=True,
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
        architectures=["DeepseekV3ForCausalLM"],
    )
    return config.to_dict()


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """Hugging Face's kv_b_proj [heads * (qk_nope + v_head), kv_lora_rank] from attn_k_b
    [heads, kv_lora_rank, qk_nope] and attn_v_b [heads, v_head, kv_lora_rank], both dense:
    k_b's blocks run along qk_nope, so it cannot be transposed still quantized (the model
    dequantizes kv_b_proj at load anyway: engine/models/deepseek_v3.py)."""
    heads, rank = k_b.shape[0], k_b.shape[1]
    if v_b.shape[0] != heads or v_b.shape[2] != rank:
        raise CheckpointError(
            f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} disagree on heads or "
            "kv_lora_rank"
        )
    joined = torch.cat([k_b.transpose(1, 2).float(), v_b.float()], dim=1)
    return joined.reshape(-1, rank).contiguous()
