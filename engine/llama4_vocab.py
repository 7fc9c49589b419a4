"""Llama 4's vocabulary and chat format, without the network and without a tokenizer.json.

Meta's llama-models package (pinned in requirements.txt; its code is never imported here)
ships Llama 4's tiktoken BPE file, `llama_models/llama4/tokenizer.model`: 200,000 ranks, split
by the o200k pattern. `vocabulary_file` finds it and checks its sha256. The special tokens
follow from 200,000 on, 2,048 of them, in llama-models' order (its llama4/tokenizer.py):
`<|begin_of_text|>` 200000, `<|end_of_text|>` 200001, `<|header_start|>` 200005,
`<|header_end|>` 200006, `<|eom|>` 200007, `<|eot|>` 200008, `<|python_start|>` 200016,
`<|python_end|>` 200017, `<|finetune_right_pad|>` 200018, the reserved text, vision and
reasoning ones, then `<|reserved_special_token_N|>` to 202,047: 202,048 ids, Llama 4's
vocab_size. Generation stops at <|end_of_text|>, <|eom|> and <|eot|> (llama-models'
stop_tokens, the published generation_config.json's eos_token_id).

A folder whose config.json is Llama 4's (`is_llama4`) and that has no tokenizer.json reads
this vocabulary (engine/tokenizer.py), and without a chat template of its own it gets
tandem's (`chat_template`, engine/chat_templates/llama4.jinja), which writes a conversation
as llama-models' ChatFormat.encode_dialog_prompt does. A published checkpoint's tokenizer.json
and template are read first; Meta's published template writes tool turns differently from
llama-models (a past call as `<|python_start|><|python_end|>{"name": ..., "parameters": ...}`,
a tool result as JSON text, both ended by <|eot|>, where llama-models writes
`{"type": "function", "name": ..., "parameters": ...}` and the result as it is, ended by <|eom|>).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os

from engine.errors import CheckpointError

PACKAGE, PACKAGED = "llama_models", os.path.join("llama4", "tokenizer.model")
SHA256 = "d0bdbaf59b0762c8c807617e2d8ea51420eb1b1de266df2495be755c8e0ed6ed"  # llama-models 0.3.0
NUM_BASE_TOKENS = 200000
NUM_SPECIAL_TOKENS = 2048
VOCAB_SIZE = NUM_BASE_TOKENS + NUM_SPECIAL_TOKENS
TEMPLATE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "chat_templates", "llama4.jinja"
)
ARCHITECTURES = ("Llama4ForConditionalGeneration", "Llama4ForCausalLM")
MODEL_TYPES = ("llama4", "llama4_text")


def _reserved(kind: str, start: int, stop: int) -> list[str]:
    return [f"<|{kind}_reserved_special_token_{i}|>" for i in range(start, stop)]


def _special_tokens() -> dict[str, int]:
    """llama-models' list, in its order: basic, text post-train, vision, reasoning, reserved."""
    text = (
        ["<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>"]
        + _reserved("text_post_train", 0, 6)
        + ["<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>"]
        + _reserved("text_post_train", 8, 69)
    )
    vision = (
        ["<|image_start|>", "<|image_end|>", *_reserved("vision", 0, 2)]
        + ["<|tile_x_separator|>", "<|tile_y_separator|>", *_reserved("vision", 2, 6)]
        + ["<|image|>", *_reserved("vision", 6, 7), "<|patch|>", *_reserved("vision", 7, 1048)]
    )
    reasoning = _reserved("reasoning", 0, 8) + [
        "<|reasoning_thinking_start|>",
        "<|reasoning_thinking_end|>",
    ]
    basic = ["<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>"]
    named = basic + ["<|fim_suffix|>"] + text + vision + reasoning
    names = named + [
        f"<|reserved_special_token_{i}|>" for i in range(NUM_SPECIAL_TOKENS - len(named))
    ]
    return {name: NUM_BASE_TOKENS + i for i, name in enumerate(names)}


SPECIAL_TOKENS = _special_tokens()
BOS_TOKEN, EOS_TOKEN = "<|begin_of_text|>", "<|eot|>"
EOS_TOKEN_IDS = tuple(SPECIAL_TOKENS[t] for t in ("<|end_of_text|>", "<|eom|>", "<|eot|>"))


def is_llama4(config: dict) -> bool:
    """A config.json of Llama 4: nested (Llama4ForConditionalGeneration) or text-only."""
    text = config.get("text_config") or {}
    return (
        config.get("model_type") in MODEL_TYPES
        or text.get("model_type") in MODEL_TYPES
        or any(a in ARCHITECTURES for a in config.get("architectures") or ())
    )


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@functools.cache
def vocabulary_file() -> str:
    """llama-models' Llama 4 tokenizer.model, checked against its sha256 (once per process)."""
    spec = importlib.util.find_spec(PACKAGE)  # finds it without importing it
    path = os.path.join(list(spec.submodule_search_locations)[0], PACKAGED) if spec else ""
    if not os.path.isfile(path):
        raise CheckpointError(
            "Llama 4's vocabulary (a checkpoint without tokenizer.json) ships in the llama-models "
            "package: pip install -r requirements.txt (make install)"
        )
    if _sha256(path) != SHA256:
        raise CheckpointError(f"{path}: not Llama 4's tokenizer.model (sha256 differs)")
    return path


@functools.cache
def encoding():
    """Llama 4's vocabulary as a tiktoken Encoding."""
    import tiktoken

    from engine.o200k import PATTERN  # Llama 4 splits text as o200k does
    from engine.tiktoken_vocab import read_ranks

    ranks = read_ranks(vocabulary_file())
    if len(ranks) != NUM_BASE_TOKENS:
        raise CheckpointError(f"{vocabulary_file()}: {len(ranks)} ranks, not {NUM_BASE_TOKENS}")
    return tiktoken.Encoding(
        name="llama4", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=SPECIAL_TOKENS
    )


@functools.cache
def chat_template() -> str:
    with open(TEMPLATE) as f:
        return f.read()


class Llama4Vocabulary:
    """engine/tokenizer.py's vocabulary interface over `encoding()`. Encoding with special
    tokens puts <|begin_of_text|> first, as the published tokenizer.json does."""

    bos_token, eos_token = BOS_TOKEN, EOS_TOKEN
    eos_token_ids = list(EOS_TOKEN_IDS)

    def __init__(self):
        self.encoding = encoding()
        self.special_ids = frozenset(SPECIAL_TOKENS.values())

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids = self.encoding.encode(text, allowed_special="all")
        bos = SPECIAL_TOKENS[BOS_TOKEN]
        return [bos] + ids if add_special_tokens and ids[:1] != [bos] else ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self.special_ids]
        return self.encoding.decode(token_ids)

    def token_to_id(self, token: str) -> int | None:
        if token in SPECIAL_TOKENS:
            return SPECIAL_TOKENS[token]
        ids = self.encoding.encode(token, allowed_special="all")
        return ids[0] if len(ids) == 1 else None
