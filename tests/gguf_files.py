"""Tiny GGUF files written with gguf-py's GGUFWriter, as llama.cpp's converter lays them out:
random weights, quantized by gguf-py where it can quantize the type, else random valid blocks
(the K-quants: gguf-py only dequantizes them), and the demo model's byte-level BPE vocabulary
as a `gpt2` tokenizer with a ChatML template."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
DEMO_TOKENIZER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo", "tandem-demo"
)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
# Byte offsets of each K-quant block's fp16 fields, and the scale their values are drawn at (so a
# random block's weights stay about 0.1).
HALF_FIELDS = {
    T.Q4_K: ((0, 2e-3), (2, 2e-3)),
    T.Q5_K: ((0, 1e-3), (2, 1e-3)),
    T.Q6_K: ((208, 1e-4),),
}
SHAPES = dict(
    vocab=2048, hidden=256, ffn=512, heads=4, kv_heads=2, layers=2, experts=4, expert_ffn=768
)
# expert_ffn: transformers' GGUF config for qwen3moe leaves moe_intermediate_size at its default, 768


def random_blocks(rng, rows: int, cols: int, kind: GGMLQuantizationType) -> np.ndarray:
    """Random valid blocks: random bytes, the fp16 scales drawn small and finite."""
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at, scale in HALF_FIELDS[kind]:
        halves = (rng.standard_normal((rows, cols // block)) * scale).astype(np.float16)
        raw[..., at : at + 2] = halves.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def encode(rng, values: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """[.., rows, cols] float32 -> the tensor as the file stores it in `kind`."""
    if kind == T.F32:
        return values.astype(np.float32)
    if kind == T.F16:
        return values.astype(np.float16)
    if kind in HALF_FIELDS:
        lead, (rows, cols) = values.shape[:-2], values.shape[-2:]
        count = int(np.prod(lead)) if lead else 1
        raw = random_blocks(rng, count * rows, cols, kind)
        return raw.reshape(*lead, rows, -1)
    return gguf.quants.quantize(values.astype(np.float32), kind)


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of a llama model's Q and K rows (convert_hf_to_gguf.py)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_tokenizer(writer: gguf.GGUFWriter) -> None:
    with open(os.path.join(DEMO_TOKENIZER, "tokenizer.json")) as f:
        spec = json.load(f)
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    vocab.update(special)
    # ChatML's markers in place of the demo's first free added tokens
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens[1], tokens[2] = "<|im_start|>", "<|im_end|>"
    types = [
        gguf.TokenType.CONTROL if i in special.values() else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(
        [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    )
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)


def write_tiny_gguf(
    path: str,
    arch: str,
    kinds: dict[str, GGMLQuantizationType],
    seed: int = 0,
    tied: bool = False,
    shapes: dict | None = None,
    context: int = 512,
    window: int = 16,
) -> str:
    """A tiny `arch` model (llama, qwen2, qwen3, qwen3moe, gemma3) at `path`. `kinds`: the type of each
    tensor group: token_embd, output, attn (q, k, v, o), ffn (gate, up, down), experts; the norms
    are F32. `shapes` overrides SHAPES' entries (a benchmark's published shape; gemma3's `layers`
    too). Returns the path."""
    s, rng = {**SHAPES, **(shapes or {})}, np.random.default_rng(seed)
    # Qwen3's heads are 128 wide whatever the hidden size, as published (transformers' GGUF
    # config for qwen3 assumes it: it does not read key_length)
    hd = 128 if arch in ("qwen3", "qwen3moe") else s["hidden"] // s["heads"]
    # gemma3: six layers unless `shapes` says, every sixth global (llama.cpp's pattern; no key
    # holds it); heads 256 wide, as published (transformers' GGUF config keeps
    # query_pre_attn_scalar at 256, llama.cpp scales by the head width: the same scale)
    num_layers = (shapes or {}).get("layers", 6) if arch == "gemma3" else s["layers"]
    hd = 256 if arch == "gemma3" else hd
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(num_layers)
    writer.add_context_length(context)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)  # gemma3's global layers'
    if arch == "gemma3":  # by default the window shorter than a test's prompt
        writer.add_sliding_window(window)
    writer.add_vocab_size(s["vocab"])
    if arch in ("qwen3", "qwen3moe", "gemma3"):
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    if arch == "qwen3moe":
        writer.add_expert_count(s["experts"])
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(s["expert_ffn"])
    write_tokenizer(writer)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    def add(name, values, kind):
        data = encode(rng, values, kind)
        writer.add_tensor(name, data, raw_dtype=None if kind in (T.F32, T.F16) else kind)

    add("token_embd.weight", weight(s["vocab"], s["hidden"]), kinds["token_embd"])
    add("output_norm.weight", 1 + weight(s["hidden"]), T.F32)
    if not tied:
        add("output.weight", weight(s["vocab"], s["hidden"]), kinds["output"])
    for i in range(num_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", 1 + weight(s["hidden"]), T.F32)
        add(p + "ffn_norm.weight", 1 + weight(s["hidden"]), T.F32)
        q, k = weight(s["heads"] * hd, s["hidden"]), weight(s["kv_heads"] * hd, s["hidden"])
        if arch == "llama":
            q, k = permute(q, s["heads"]), permute(k, s["kv_heads"])
        add(p + "attn_q.weight", q, kinds["attn"])
        add(p + "attn_k.weight", k, kinds["attn"])
        add(p + "attn_v.weight", weight(s["kv_heads"] * hd, s["hidden"]), kinds["attn"])
        add(p + "attn_output.weight", weight(s["hidden"], s["heads"] * hd), kinds["attn"])
        if arch == "qwen2":
            for name, rows in (
                ("attn_q", s["heads"]),
                ("attn_k", s["kv_heads"]),
                ("attn_v", s["kv_heads"]),
            ):
                add(p + name + ".bias", weight(rows * hd), T.F32)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            add(p + "attn_q_norm.weight", 1 + weight(hd), T.F32)
            add(p + "attn_k_norm.weight", 1 + weight(hd), T.F32)
        if arch == "gemma3":  # norms after attention and the MLP, stored as 1 + w
            add(p + "post_attention_norm.weight", 1 + weight(s["hidden"]), T.F32)
            add(p + "post_ffw_norm.weight", 1 + weight(s["hidden"]), T.F32)
        if arch == "qwen3moe":
            e, f = s["experts"], s["expert_ffn"]
            add(p + "ffn_gate_inp.weight", weight(e, s["hidden"]), T.F32)
            add(p + "ffn_gate_exps.weight", weight(e, f, s["hidden"]), kinds["experts"])
            add(p + "ffn_up_exps.weight", weight(e, f, s["hidden"]), kinds["experts"])
            add(p + "ffn_down_exps.weight", weight(e, s["hidden"], f), kinds["experts"])
        else:
            add(p + "ffn_gate.weight", weight(s["ffn"], s["hidden"]), kinds["ffn"])
            add(p + "ffn_up.weight", weight(s["ffn"], s["hidden"]), kinds["ffn"])
            add(p + "ffn_down.weight", weight(s["hidden"], s["ffn"]), kinds["ffn"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def model_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """A transformers model's greedy tokens for `steps` steps past `prompt` (no stop token), and
    each step's logprob."""
    import torch

    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
    return tokens, logprobs
