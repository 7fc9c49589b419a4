"""A GGUF file with gemma-3-270m's published shape and random weights, for long-prompt speed.

No Gemma 3 checkpoint installs from a package registry (Google's terms gate the downloads), and
prefill speed depends on the shape, not on the values: 18 layers 640 wide, 4 query heads and 1
KV head 256 wide, an MLP 2,048 wide, every sixth layer global and the rest sliding over 512
tokens, a 32,768-token context, Q8_0 as the published Q8_0 file. The vocabulary is the demo's
(2,050 tokens, not Gemma's 262,144): a prefill computes the LM head for its last token only.

    .venv/bin/python -m bench.gemma3_file    # prints the file's path (written once, in seconds)
"""

from __future__ import annotations

import os
import sys

from bench.checkpoints import DEFAULT_ROOT

# vocab: the demo tokenizer's 2,050 tokens (llama.cpp checks the embedding's rows against them)
SHAPE = dict(vocab=2050, hidden=640, ffn=2048, heads=4, kv_heads=1, layers=18)
CONTEXT, WINDOW = 32768, 512
PATH = os.path.join(DEFAULT_ROOT, "gemma3-270m-shaped.Q8_0.gguf")


def gemma3_file() -> str:
    if os.path.isfile(PATH):
        return PATH
    from gguf import GGMLQuantizationType as T

    from tests.gguf_files import write_tiny_gguf

    print(f"writing {PATH} (once) ...", file=sys.stderr)
    os.makedirs(DEFAULT_ROOT, exist_ok=True)
    partial = PATH + ".partial"
    kinds = dict(token_embd=T.Q8_0, attn=T.Q8_0, ffn=T.Q8_0)
    write_tiny_gguf(
        partial, "gemma3", kinds, tied=True, shapes=SHAPE, context=CONTEXT, window=WINDOW
    )
    os.rename(partial, PATH)
    return PATH


if __name__ == "__main__":
    print(gemma3_file())
