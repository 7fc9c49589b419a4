"""Paged attention with Triton's decode kernel (engine/triton/paged_decode.py): decodes read
their context in place from the pool; short queries and prompt chunks go through the torch
backend's SDPA (on CUDA, its flash kernel). The plans are the torch backend's, with each
decode group's context lengths, so CUDA graphs capture it as they capture that backend
(engine/cuda_graphs.py).

Made for CUDA, where torch's wheels ship Triton; without CUDA the kernel runs in Triton's
interpreter, for tests only.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBatch
from engine.attention.torch_backend import TorchAttentionMetadata, TorchBackend, _Group
from engine.triton.paged_decode import paged_decode_attention


class TritonBackend(TorchBackend):
    def plan(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        meta = super().plan(batch)
        decodes = [c for n, c in zip(batch.query_lens, batch.context_lens) if n == 1]
        if decodes:  # the decode group is the plan's first
            meta.groups[0].context_lens = torch.tensor(decodes, device=self.device)
        return meta

    def plan_decode(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
    ) -> TorchAttentionMetadata:
        meta = super().plan_decode(slot_mapping, block_tables, context_lens)
        meta.groups[0].context_lens = context_lens
        return meta

    def _attend(self, q, kv_layer, k_pages, v_pages, g: _Group, sinks=None) -> torch.Tensor:
        if g.max_query_len > 1 or sinks is not None:  # the decode kernel takes no sinks
            return super()._attend(q, kv_layer, k_pages, v_pages, g, sinks)
        return paged_decode_attention(
            q, kv_layer, g.block_tables, g.context_lens, self.scale, self.sliding_window, self.v_dim
        )
