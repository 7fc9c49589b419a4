"""The attention backend contract: one small interface, picked by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionBatch:
    """What a step attends over, in flat token order (each sequence's new tokens contiguous).

    query_lens[i] new tokens of sequence i sit at positions context_lens[i] - query_lens[i]
    ... context_lens[i] - 1; its KV lives in the pages block_tables[i].
    """

    query_lens: list[int]
    context_lens: list[int]  # tokens of KV after this step (cached + computed + new)
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] long: block_id * block_size + offset


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged pool and attends each query over its context.

    `plan` runs once per step, before the forward pass, and returns backend metadata that
    `forward` reuses in every layer. `forward` must write k and v at `slot_mapping` before
    attending, so a query sees its own token.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 sliding_window: int | None, device: torch.device, dtype: torch.dtype,
                 latent_v_dim: int | None = None, scale: float | None = None):
        """`latent_v_dim` (multi-head latent attention): K and V are one cache entry, V its first
        `latent_v_dim` columns, so forward takes no v and returns [T, num_heads, latent_v_dim].
        `scale`: the softmax scale, head_dim ** -0.5 unless given."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.latent_v_dim = latent_v_dim
        self.v_dim = latent_v_dim or head_dim
        self.entries = 1 if latent_v_dim else 2  # cache entries per token: K and V, or the latent
        self.scale = scale if scale is not None else head_dim**-0.5
        self.device = device
        self.dtype = dtype

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> object:
        ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, kv_layer: torch.Tensor,
                meta) -> torch.Tensor:
        """q: [T, num_heads, head_dim], k/v: [T, num_kv_heads, head_dim] (v None with a latent),
        kv_layer: [num_blocks, entries, block_size, num_kv_heads, head_dim]. Returns [T, num_heads, v_dim]."""
