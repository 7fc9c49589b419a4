"""Deterministic random-weight Llama checkpoints for the engine benchmark.

Weights come from `torch.manual_seed(0)` and transformers' own initialisation, so every run
(and every machine with the same transformers) benchmarks the same bytes. Each checkpoint is
made in fp32 and then cast, so the bf16 folder holds the fp32 weights rounded, not a second
draw. Folders are cached; a folder whose recorded spec differs is rebuilt.

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
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=688, vocab_size=2048, max_position_embeddings=2048,
    ),
    "small": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
        intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048,
    ),
    # ~102M parameters, a Qwen3-MoE: 10 experts of width 512, top 2, in each of 8 layers.
    "moe": dict(
        architecture="qwen3_moe", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, intermediate_size=1024, moe_intermediate_size=512, num_experts=10,
        num_experts_per_tok=2, norm_topk_prob=True, vocab_size=32000, max_position_embeddings=2048,
    ),
}
DTYPES = ("float32", "bfloat16")


def checkpoint_dir(name: str, dtype: str, root: str = DEFAULT_ROOT) -> str:
    return os.path.join(root, f"{name}-{dtype}")


def make_checkpoint(name: str, dtype: str, folder: str | None = None) -> str:
    """Create (or reuse) checkpoint `name` saved in `dtype`; returns its folder."""
    if name not in CHECKPOINTS or dtype not in DTYPES:
        raise ValueError(f"unknown checkpoint {name!r}/{dtype!r}; have {list(CHECKPOINTS)} x {list(DTYPES)}")
    folder = folder or checkpoint_dir(name, dtype)
    spec = {"name": name, "dtype": dtype, "seed": SEED, "config": CHECKPOINTS[name]}
    spec_path = os.path.join(folder, SPEC_FILE)
    if os.path.isfile(spec_path):
        with open(spec_path) as f:
            if json.load(f) == spec:
                return folder
    import torch
    import transformers

    shutil.rmtree(folder, ignore_errors=True)
    torch.manual_seed(SEED)
    fields = dict(CHECKPOINTS[name])
    family = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}[fields.pop("architecture", "llama")]
    config = getattr(transformers, family[0])(**fields, tie_word_embeddings=False)
    model = getattr(transformers, family[1])(config).to(getattr(torch, dtype))
    model.save_pretrained(folder)  # safetensors; config.json records the dtype
    # Written last: a folder interrupted mid-save has no spec and is rebuilt next time.
    with open(spec_path, "w") as f:
        json.dump(spec, f, indent=1)
    return folder


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
    """Weight bytes one decode step must read: every tensor but the input embedding table.

    The embedding lookup reads one row per token (negligible); lm_head, the layers and the
    norms are read in full. KV cache reads are left out: at the benchmark's short contexts
    they are well under 1% of the weights.
    """
    sizes = tensor_bytes(folder)
    with open(os.path.join(folder, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    skip = set() if tied else {"model.embed_tokens.weight"}
    return sum(n for tensor, n in sizes.items() if tensor not in skip)


if __name__ == "__main__":
    # python bench/checkpoints.py [NAMES [DTYPES]]  (comma-separated; default: all)
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CHECKPOINTS)
    dtypes = sys.argv[2].split(",") if len(sys.argv) > 2 else list(DTYPES)
    for name in names:
        for dtype in dtypes:
            path = make_checkpoint(name, dtype)
            print(f"{path}: {decode_weight_bytes(path) / 1e6:.1f} MB read per decode step", file=sys.stderr)
