"""Deterministic random-weight checkpoints for the engine benchmark.

Weights come from `torch.manual_seed(0)` and transformers' own initialisation, so every run
(and every machine with the same transformers) benchmarks the same bytes. Each checkpoint is
made in fp32 and then cast, so the bf16 folder holds the fp32 weights rounded, not a second
draw; the quantized variants (`fp8`, `int4`: bench/quantize.py, the layouts Kimi K2 and K2.5
publish) are the bf16 folder rewritten, computed in bf16. Folders are cached; a folder whose
recorded spec differs is rebuilt.

No tokenizer is written: every engine here is fed token ids.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_ROOT = os.path.join(REPO_ROOT, "build", "bench-checkpoints")
SPEC_FILE = "bench-spec.json"
SEED = 0

# LlamaConfig fields. "small" is ~125M parameters (untied embeddings: 2 x 24.6M of them).
CHECKPOINTS = {
    "tiny": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=688,
        vocab_size=2048,
        max_position_embeddings=2048,
    ),
    "small": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
        max_position_embeddings=2048,
    ),
    # ~102M parameters, a Qwen3-MoE: 10 experts of width 512, top 2, in each of 8 layers.
    "moe": dict(
        architecture="qwen3_moe",
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1024,
        moe_intermediate_size=512,
        num_experts=10,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        vocab_size=32000,
        max_position_embeddings=2048,
    ),
    # ~1.1B parameters shaped like Kimi K2.5 (DeepSeek-V3's architecture): MLA, a dense first
    # layer, then 64 routed experts (top 8, sigmoid, no groups) and a shared one in each of 7
    # layers, yarn factor 64. At batch 1 a token reads 8 of the 64 experts: the routed share of
    # its bytes (bf16) is about two thirds, as in K2.5.
    "kimi": dict(
        architecture="deepseek_v3",
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=2816,
        moe_intermediate_size=768,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        vocab_size=16384,
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
DTYPES = ("float32", "bfloat16", "fp8", "int4")
QUANTIZED = ("fp8", "int4")  # weights as Kimi K2 (FP8 blocks) and K2.5 (INT4 experts) publish them


def compute_dtype(dtype: str) -> str:
    """The engine's dtype for a variant: the quantized ones compute in bf16."""
    return "bfloat16" if dtype in QUANTIZED else dtype


def checkpoint_dir(name: str, dtype: str, root: str = DEFAULT_ROOT) -> str:
    return os.path.join(root, f"{name}-{dtype}")


def make_checkpoint(name: str, dtype: str, folder: str | None = None) -> str:
    """Create (or reuse) checkpoint `name` saved in `dtype`; returns its folder."""
    if name not in CHECKPOINTS or dtype not in DTYPES:
        raise ValueError(
            f"unknown checkpoint {name!r}/{dtype!r}; have {list(CHECKPOINTS)} x {list(DTYPES)}"
        )
    folder = folder or checkpoint_dir(name, dtype)
    spec = {"name": name, "dtype": dtype, "seed": SEED, "config": CHECKPOINTS[name]}
    if dtype in QUANTIZED:
        from bench.quantize import LAYOUT_REVISION

        spec["layout"] = LAYOUT_REVISION
    spec_path = os.path.join(folder, SPEC_FILE)
    if os.path.isfile(spec_path):
        with open(spec_path) as f:
            if json.load(f) == spec:
                return folder
    shutil.rmtree(folder, ignore_errors=True)
    if dtype in QUANTIZED:
        from bench.quantize import FP8_CONFIG, INT4_CONFIG, fp8_blocks, int4_experts, rewrite

        shutil.copytree(make_checkpoint(name, "bfloat16"), folder)
        os.remove(os.path.join(folder, SPEC_FILE))
        quantize, config = (
            (fp8_blocks, FP8_CONFIG) if dtype == "fp8" else (int4_experts, INT4_CONFIG)
        )
        rewrite(folder, quantize, config)
    else:
        import torch
        import transformers

        torch.manual_seed(SEED)
        fields = dict(CHECKPOINTS[name])
        family = {
            "llama": ("LlamaConfig", "LlamaForCausalLM"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
        }[fields.pop("architecture", "llama")]
        config = getattr(transformers, family[0])(**fields, tie_word_embeddings=False)
        model = getattr(transformers, family[1])(config).to(getattr(torch, dtype))
        model.save_pretrained(folder)  # safetensors; config.json records the dtype
    # Written last: a folder interrupted mid-save has no spec and is rebuilt next time.
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=1)
    return folder


def file_bytes(folder: str) -> int:
    """The folder's safetensors bytes on disk."""
    return sum(
        os.path.getsize(os.path.join(folder, f))
        for f in os.listdir(folder)
        if f.endswith(".safetensors")
    )


def tensor_bytes(folder: str) -> dict[str, int]:
    """Bytes of every tensor in the folder's safetensors files, read from their headers only."""
    sizes = {}
    for file in sorted(os.listdir(folder)):
        if not file.endswith(".safetensors"):
            continue
        with open(os.path.join(folder, file), "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for tensor, meta in header.items():
            if tensor != "__metadata__":
                begin, end = meta["data_offsets"]
                sizes[tensor] = end - begin
    return sizes


def decode_weight_bytes(folder: str) -> int:
    """Weight bytes a batch-1 decode step must read: every tensor but the input embedding
    table, and of a mixture of experts' routed experts the share one token chooses.

    The embedding lookup reads one row per token (negligible); lm_head, the layers and the
    norms are read in full. KV cache reads are left out: at the benchmark's short contexts
    they are well under 1% of the weights.
    """
    sizes = tensor_bytes(folder)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    skip = set() if config.get("tie_word_embeddings", False) else {"model.embed_tokens.weight"}
    experts = config.get("n_routed_experts") or config.get("num_experts") or 1
    chosen = config.get("num_experts_per_tok", experts) / experts
    return round(
        sum(
            n * (chosen if ".mlp.experts." in tensor else 1)
            for tensor, n in sizes.items()
            if tensor not in skip
        )
    )


if __name__ == "__main__":
    # python bench/checkpoints.py [NAMES [DTYPES]]  (comma-separated; default: all)
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CHECKPOINTS)
    dtypes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(DTYPES)
    for name in names:
        for dtype in dtypes:
            path = make_checkpoint(name, dtype)
            print(
                f"{path}: {decode_weight_bytes(path) / 1e6:.1f} MB read per decode step",
                file=sys.stderr,
            )
