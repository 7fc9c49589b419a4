"""A tiny DeepSeek-V3 written as llama.cpp's converter writes deepseek2 (convert_hf_to_gguf.py's
DeepseekV2Model), for a golden test against transformers, which cannot read deepseek2 files.

The Hugging Face model is tests/tiny_models.py's deepseek_v3_yarn (MLA with a q latent, yarn
RoPE, a dense first layer, grouped sigmoid routing with a correction bias, a shared expert),
widened so every quantized row is whole 32-weight blocks. Its weights are written as the
converter lays them out (no rows permuted; experts stacked; kv_b_proj split per head into
attn_k_b, transposed, and attn_v_b, or kept as attn_kv_b as older files do), quantized by
gguf-py, and then replaced in the model by gguf-py's dequantization of what was written: the
model and the file hold the same weights.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf.quants import dequantize

from tests.gguf_files import SHAPES, T, encode, write_tokenizer
from tests.tiny_models import build_hf_model

WIDTHS = dict(
    vocab_size=SHAPES["vocab"],
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
)
# kv_b: "split" (attn_k_b / attn_v_b and newer metadata: one KV head of the absorbed width,
# key_length_mla), "joined" (attn_kv_b and older metadata: the per-head widths as key_length),
# "no_q_lora" (split, and a plain attn_q as in V2-Lite: no q latent), "both" (attn_kv_b beside
# attn_k_b / attn_v_b, as converters of mid-2025 wrote; the halves in Q4_0, so reading them in
# place of attn_kv_b shows).
FORMS = ("split", "joined", "no_q_lora", "both")


def tiny_deepseek_v3(form: str, seed: int = 0):
    """The Hugging Face model a form is written from."""
    extra = dict(q_lora_rank=None) if form == "no_q_lora" else {}
    return build_hf_model("deepseek_v3_yarn", seed=seed, **{**WIDTHS, **extra})


def _metadata(writer: gguf.GGUFWriter, cfg, form: str) -> None:
    rope = cfg.rope_parameters
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    qk, rank = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if form == "joined":
        writer.add_head_count_kv(cfg.num_attention_heads)
        writer.add_key_length(qk)
        writer.add_value_length(cfg.v_head_dim)
    else:  # MLA described as MQA over the latent
        writer.add_head_count_kv(1)
        writer.add_key_length(rank + cfg.qk_rope_head_dim)
        writer.add_value_length(rank)
        writer.add_key_length_mla(qk)
        writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_group_count(cfg.n_group)
    writer.add_expert_group_used_count(cfg.topk_group)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    writer.add_expert_weights_norm(cfg.norm_topk_prob)
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    write_tokenizer(writer)


def write_deepseek2_gguf(model, path: str, kinds: dict, form: str = "split", seed: int = 0) -> str:
    """`model` (tiny_deepseek_v3(form)) as a deepseek2 file at `path`; its weights become the
    file's. `kinds`: the type of token_embd, output, attn (q, kv_a, kv_b or k_b / v_b, o), ffn
    (the dense layers' MLP and the shared experts) and experts; norms, the router and its bias
    are F32, as llama.cpp keeps them. Returns the path."""
    cfg, rng = model.config, np.random.default_rng(seed)
    state = model.state_dict()
    writer = gguf.GGUFWriter(path, "deepseek2")
    _metadata(writer, cfg, form)

    def add(name: str, values: torch.Tensor, kind) -> torch.Tensor:
        """Writes `values`; returns what the file holds, as fp32."""
        data = encode(rng, values.float().contiguous().numpy(), kind)
        writer.add_tensor(name, data, raw_dtype=None if kind in (T.F32, T.F16) else kind)
        return torch.from_numpy(dequantize(data, kind).copy()).reshape(values.shape)

    def put(hf: str, name: str, kind) -> None:
        state[hf].copy_(add(name, state[hf], kind))

    put("model.embed_tokens.weight", "token_embd.weight", kinds["token_embd"])
    put("model.norm.weight", "output_norm.weight", T.F32)
    put("lm_head.weight", "output.weight", kinds["output"])
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(p + "input_layernorm.weight", b + "attn_norm.weight", T.F32)
        put(p + "post_attention_layernorm.weight", b + "ffn_norm.weight", T.F32)
        a = p + "self_attn."
        if cfg.q_lora_rank:
            put(a + "q_a_proj.weight", b + "attn_q_a.weight", kinds["attn"])
            put(a + "q_a_layernorm.weight", b + "attn_q_a_norm.weight", T.F32)
            put(a + "q_b_proj.weight", b + "attn_q_b.weight", kinds["attn"])
        else:
            put(a + "q_proj.weight", b + "attn_q.weight", kinds["attn"])
        put(a + "kv_a_proj_with_mqa.weight", b + "attn_kv_a_mqa.weight", kinds["attn"])
        put(a + "kv_a_layernorm.weight", b + "attn_kv_a_norm.weight", T.F32)
        put(a + "o_proj.weight", b + "attn_output.weight", kinds["attn"])
        kv_b = state[a + "kv_b_proj.weight"]
        if form != "joined":  # the converter's split: k_b [heads, rank, nope], v_b [heads, v, rank]
            half = T.Q4_0 if form == "both" else kinds["attn"]
            k_b, v_b = kv_b.view(heads, nope + v, -1).split([nope, v], dim=1)
            k_b = add(b + "attn_k_b.weight", k_b.transpose(1, 2).contiguous(), half)
            v_b = add(b + "attn_v_b.weight", v_b.contiguous(), half)
            if form != "both":
                kv_b.copy_(torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(kv_b.shape))
        if form in ("joined", "both"):
            put(a + "kv_b_proj.weight", b + "attn_kv_b.weight", kinds["attn"])
        m = p + "mlp."
        if i < cfg.first_k_dense_replace:
            for part in ("gate", "up", "down"):
                put(f"{m}{part}_proj.weight", f"{b}ffn_{part}.weight", kinds["ffn"])
            continue
        put(m + "gate.weight", b + "ffn_gate_inp.weight", T.F32)
        put(m + "gate.e_score_correction_bias", b + "exp_probs_b.bias", T.F32)
        for part in ("gate", "up", "down"):
            put(
                f"{m}shared_experts.{part}_proj.weight", f"{b}ffn_{part}_shexp.weight", kinds["ffn"]
            )
        gate_up, width = state[m + "experts.gate_up_proj"], cfg.moe_intermediate_size
        gate_up[:, :width] = add(b + "ffn_gate_exps.weight", gate_up[:, :width], kinds["experts"])
        gate_up[:, width:] = add(b + "ffn_up_exps.weight", gate_up[:, width:], kinds["experts"])
        put(m + "experts.down_proj", b + "ffn_down_exps.weight", kinds["experts"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
