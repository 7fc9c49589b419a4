"""Attention backends by name. FlashInfer and Triton are imported only when chosen (made for
CUDA; Triton's kernel also runs in its interpreter on CPU, for tests). On CPU, `auto` is
`invariant` while the batch-invariant kernels are on (the default), else `torch`. A model whose
heads have sinks (gpt-oss) gets `torch` where `auto` would pick FlashInfer, which takes none."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionBatch
from engine.layers.kernel_choice import invariant_kernels

BACKENDS = ("torch", "invariant", "flashinfer", "triton")


def resolve_backend_name(name: str, device: torch.device) -> str:
    if name == "auto":
        if device.type != "cuda":
            return "invariant" if invariant_kernels() else "torch"
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            return "torch"
        return "flashinfer"
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}"
        )
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError("the flashinfer attention backend needs a CUDA device")
    if name == "invariant" and (device.type != "cpu" or not invariant_kernels()):
        raise ValueError(
            "the invariant attention backend needs the CPU with the batch-invariant ops built "
            "(`make install`) and TANDEM_KERNELS=invariant"
        )
    return name


def create_backend(
    name: str, sliding_layers: tuple[int, ...] | None = None, sinks: bool = False, **kwargs
) -> AttentionBackend:
    """`sliding_layers`: only these layers attend over kwargs' sliding_window (Gemma 3) or within
    chunks of its chunk_size (Llama 4), each window its own backend (layer_windows.py); None:
    every layer alike. `sinks`: the layers pass
    a sink logit per head (AttentionBackend.forward), so the backend must take them."""
    if sinks and resolve_backend_name(name, kwargs["device"]) == "flashinfer":
        if name == "flashinfer":
            raise ValueError(
                "the flashinfer attention backend takes no attention sinks (gpt-oss): choose "
                "torch or triton"
            )
        name = "torch"
    windowed = kwargs.get("sliding_window") is not None or kwargs.get("chunk_size") is not None
    if sliding_layers is not None and windowed:
        from engine.attention.layer_windows import LayerWindows

        full = {**kwargs, "sliding_window": None, "chunk_size": None}
        return LayerWindows(_create(name, **kwargs), _create(name, **full), sliding_layers, **full)
    return _create(name, **kwargs)


def _create(name: str, **kwargs) -> AttentionBackend:
    name = resolve_backend_name(name, kwargs["device"])
    if kwargs.get("chunk_size") and name in ("flashinfer", "triton"):
        name = "torch"  # neither kernel attends within chunks: SDPA with the chunks' mask
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(**kwargs)
    if name == "invariant":
        from engine.attention.invariant_backend import InvariantBackend

        return InvariantBackend(**kwargs)
    if name == "triton":
        from engine.attention.triton_backend import TritonBackend

        return TritonBackend(**kwargs)
    from engine.attention.torch_backend import TorchBackend

    return TorchBackend(**kwargs)


__all__ = ["AttentionBackend", "AttentionBatch", "create_backend", "resolve_backend_name"]
