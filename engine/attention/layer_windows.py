"""Attention for models whose layers attend over different windows (Gemma 3: five sliding-window
layers to one global; Llama 4: three layers attending within chunks to one global). A backend
takes its window when it is built and may plan with it (the torch backend's masks, FlashInfer's
plan), so there is one backend per window, each planned once a step; a layer attends through
its window's (`layer(i)`) with that backend's share of the plan.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionBatch


class LayerWindows(AttentionBackend):
    def __init__(
        self,
        sliding: AttentionBackend,
        full: AttentionBackend,
        sliding_layers: tuple[int, ...],
        **shape,
    ):
        """`sliding`, `full`: the backends of the window and of none; `sliding_layers`: the
        layers that attend over the window. `shape`: the backends' (block_size, dtype, ...)."""
        super().__init__(**{**shape, "sliding_window": None})
        self.backends = (sliding, full)
        self.sliding_layers = frozenset(sliding_layers)

    def plan(self, batch: AttentionBatch) -> tuple:
        return tuple(backend.plan(batch) for backend in self.backends)

    def plan_decode(self, *args) -> tuple:
        """TorchBackend.plan_decode of each window (CUDA graphs capture it: engine/cuda_graphs.py)."""
        return tuple(backend.plan_decode(*args) for backend in self.backends)

    def layer(self, i: int) -> _WindowOf:
        return _WindowOf(self.backends, 0 if i in self.sliding_layers else 1)

    def forward(self, q, k, v, kv_layer, meta, sinks=None) -> torch.Tensor:
        raise TypeError("a layer attends through LayerWindows.layer(i)")


class _WindowOf:
    """One window's backend, given the step's plans of every window."""

    def __init__(self, backends: tuple[AttentionBackend, ...], which: int):
        self.backend, self.which = backends[which], which

    def forward(self, q, k, v, kv_layer, meta: tuple, sinks=None) -> torch.Tensor:
        return self.backend.forward(q, k, v, kv_layer, meta[self.which], sinks)
