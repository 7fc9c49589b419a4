"""Models big enough to be bound by memory bandwidth on a GPU, their weights random and made on
the device (nothing on disk: 16-47 GB would take longer to write than to measure):

- `llama-8b`: Llama-3-8B's shape (32 layers, hidden 4096, GQA 32/8, MLP 14336, vocab 128256);
- `kimi-moe`: Kimi K2.5's widths (hidden 7168, MLA with 64 heads, 64 routed experts of 2048
  with 8 chosen and a shared one, vocab 163840), 6 layers (the first dense): a token reads
  about what a K2.5 layer reads, per layer. (In bf16, 34 GB; two engines' expert stacks and
  the weights made for them fit an H200's 141 GB.)

Each in `bfloat16`, `fp8` (DeepSeek-V3 / Kimi K2's blocks on every projection) and `int4`
(K2.5's groups: the routed experts; the Llama's every projection), named and shaped as the
published checkpoints are, so the engine loads them through its checkpoint path. `--dry`
shrinks every width for a CPU run of the same code.
"""

from __future__ import annotations

import json
import os
import tempfile

import torch

from bench.quantize import FP8_CONFIG, INT4_CONFIG

SHAPES = {
    "llama-8b": dict(
        architecture="llama",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "kimi-moe": dict(
        architecture="deepseek_v3",
        hidden_size=7168,
        num_hidden_layers=6,
        num_attention_heads=64,
        num_key_value_heads=64,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        vocab_size=163840,
        max_position_embeddings=262144,
        experts_implementation="eager",
        rope_parameters=dict(
            rope_type="yarn",
            factor=64.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            rope_theta=50000.0,
        ),
    ),
}
# --dry: the same models with every width cut (a CPU runs them in seconds).
DRY = {
    "llama-8b": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, vocab_size=1024),
    "kimi-moe": dict(
        hidden_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        moe_intermediate_size=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        vocab_size=1024,
    ),
}
KINDS = ("bfloat16", "fp8", "int4")
FAMILY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}


def _hf_config(shape: str, dry: bool):
    """transformers' config of the model: what config.json holds."""
    import transformers

    fields = dict(SHAPES[shape], **(DRY[shape] if dry else {}))
    config_class, model_class = FAMILY[fields.pop("architecture")]
    config = getattr(transformers, config_class)(**fields, tie_word_embeddings=False)
    config.architectures = [model_class]
    return config


def _quantized(name: str, shape: tuple[int, ...], kind: str, moe: bool) -> bool:
    """Which weights a published checkpoint of this kind stores quantized (bench/quantize.py)."""
    if kind == "bfloat16" or len(shape) != 2 or not name.endswith("_proj.weight"):
        return False
    return kind == "fp8" or not moe or ".mlp.experts." in name


def model_folder(shape: str, kind: str, dry: bool = False) -> str:
    """A folder with the model's config.json alone (the engine reads its config there)."""
    config = _hf_config(shape, dry).to_dict()
    config["torch_dtype"] = "bfloat16"
    if kind == "fp8":
        config["quantization_config"] = FP8_CONFIG
    elif kind == "int4":
        int4 = json.loads(json.dumps(INT4_CONFIG))
        if "n_routed_experts" not in config:  # a dense model: every projection but lm_head
            int4["ignore"] = ["lm_head"]
        config["quantization_config"] = int4
    folder = tempfile.mkdtemp(prefix=f"{shape}-{kind}-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def checkpoint_shapes(shape: str, dry: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in the published (Hugging Face) layout, experts one by one."""
    c = dict(SHAPES[shape], **(DRY[shape] if dry else {}))
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }

    def mlp(prefix: str, width: int) -> None:
        shapes[prefix + "gate_proj.weight"] = (width, hidden)
        shapes[prefix + "up_proj.weight"] = (width, hidden)
        shapes[prefix + "down_proj.weight"] = (hidden, width)

    heads = c["num_attention_heads"]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        a = p + "self_attn."
        if c["architecture"] == "llama":
            head_dim, kv = hidden // heads, c["num_key_value_heads"]
            shapes[a + "q_proj.weight"] = (heads * head_dim, hidden)
            shapes[a + "k_proj.weight"] = (kv * head_dim, hidden)
            shapes[a + "v_proj.weight"] = (kv * head_dim, hidden)
            shapes[a + "o_proj.weight"] = (hidden, heads * head_dim)
            mlp(p + "mlp.", c["intermediate_size"])
            continue
        q_lora, kv_lora = c["q_lora_rank"], c["kv_lora_rank"]
        nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        shapes[a + "q_a_proj.weight"] = (q_lora, hidden)
        shapes[a + "q_a_layernorm.weight"] = (q_lora,)
        shapes[a + "q_b_proj.weight"] = (heads * (nope + rope), q_lora)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (kv_lora + rope, hidden)
        shapes[a + "kv_a_layernorm.weight"] = (kv_lora,)
        shapes[a + "kv_b_proj.weight"] = (heads * (nope + v), kv_lora)
        shapes[a + "o_proj.weight"] = (hidden, heads * v)
        if i < c["first_k_dense_replace"]:
            mlp(p + "mlp.", c["intermediate_size"])
            continue
        experts, width = c["n_routed_experts"], c["moe_intermediate_size"]
        shapes[p + "mlp.gate.weight"] = (experts, hidden)
        shapes[p + "mlp.gate.e_score_correction_bias"] = (experts,)
        for e in range(experts):
            mlp(f"{p}mlp.experts.{e}.", width)
        mlp(p + "mlp.shared_experts.", width * c["n_shared_experts"])
    return shapes


def random_weights(
    shape: str, kind: str, device: torch.device, dry: bool = False, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor of the model, random, made on `device`."""
    moe = "n_routed_experts" in SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, size in checkpoint_shapes(shape, dry).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(size, dtype=torch.bfloat16, device=device)
        elif name.endswith("e_score_correction_bias"):
            weights[name] = torch.zeros(size, dtype=torch.float32, device=device)
        elif not _quantized(name, size, kind, moe):
            weights[name] = torch.empty(size, dtype=torch.bfloat16, device=device).normal_(
                0, 0.02, generator=gen
            )
        elif kind == "fp8":  # N(0, 1) in e4m3, scaled to N(0, 0.02) by its blocks
            base = name.removesuffix(".weight")
            weights[name] = (
                torch.empty(size, dtype=torch.bfloat16, device=device)
                .normal_(0, 1, generator=gen)
                .to(torch.float8_e4m3fn)
            )
            blocks = tuple(-(-n // 128) for n in size)
            weights[base + ".weight_scale_inv"] = torch.full(blocks, 0.02, device=device)
        else:  # int4: uniform nibbles (values -8..7, deviation 4.6), scaled to about N(0, 0.02)
            base = name.removesuffix(".weight")
            out, cols = size
            weights[base + ".weight_packed"] = torch.randint(
                -(2**31),
                2**31 - 1,
                (out, cols // 8),
                dtype=torch.int32,
                device=device,
                generator=gen,
            )
            weights[base + ".weight_scale"] = torch.full(
                (out, cols // 32), 0.02 / 4.6, dtype=torch.bfloat16, device=device
            )
            weights[base + ".weight_shape"] = torch.tensor([out, cols])
    return weights


def decode_bytes(weights: dict[str, torch.Tensor], folder: str) -> int:
    """Bytes a batch-1 decode step reads: every tensor but the input embeddings, and of the
    routed experts the share a token chooses (as bench/checkpoints.py's decode_weight_bytes)."""
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    experts = config.get("n_routed_experts") or 1
    chosen = config.get("num_experts_per_tok", experts) / experts
    return round(
        sum(
            t.numel() * t.element_size() * (chosen if ".mlp.experts." in n else 1)
            for n, t in weights.items()
            if n != "model.embed_tokens.weight"
        )
    )
