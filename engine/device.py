"""Where and in what an engine computes: the device (`auto`: CUDA when there is one) and the
dtype (`auto`: the checkpoint's, fp32 for fp16 on CPU), for the engine, its parallel ranks and
the draft service alike."""

from __future__ import annotations

import torch

from engine.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = model.torch_dtype if model.torch_dtype in DTYPES else "float32"
        if name == "float16" and device.type != "cuda":
            name = "float32"  # fp16 matmuls are slow or missing on CPU
    if name == "float16" and device.type != "cuda":
        raise ValueError("float16 is supported on CUDA only; use float32 or bfloat16 on CPU")
    return DTYPES[name]
