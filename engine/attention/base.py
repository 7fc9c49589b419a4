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

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        sliding_window: int | None,
        device: torch.device,
        dtype: torch.dtype,
        latent_v_dim: int | None = None,
        scale: float | None = None,
        chunk_size: int | None = None,
    ):
        """`latent_v_dim` (multi-head latent attention): K and V are one cache entry, V its first
        `latent_v_dim` columns, so forward takes no v and returns [T, num_heads, latent_v_dim].
        `scale`: the softmax scale, head_dim ** -0.5 unless given. `chunk_size`: local attention
        in chunks (Llama 4): a token at pos sees keys pos - pos % chunk_size .. pos."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.chunk_size = chunk_size
        self.latent_v_dim = latent_v_dim
        self.v_dim = latent_v_dim or head_dim
        self.entries = 1 if latent_v_dim else 2  # cache entries per token: K and V, or the latent
        self.scale = scale if scale is not None else head_dim**-0.5
        self.device = device
        self.dtype = dtype

    @abstractmethod
    def plan(self, batch: AttentionBatch) -> object: ...

    def layer(self, i: int) -> AttentionBackend:
        """What layer i attends through: this backend (LayerWindows: its window's)."""
        return self

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None,
        kv_layer: torch.Tensor,
        meta,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, num_heads, head_dim], k/v: [T, num_kv_heads, head_dim] (v None with a latent),
        kv_layer: [num_blocks, entries, block_size, num_kv_heads, head_dim]; sinks: fp32
        [num_heads], a logit per query head that joins each softmax and weighs no value
        (gpt-oss), or None. Returns [T, num_heads, v_dim]."""

    def k_rows(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        # A layer's pool [blocks, entries, block_size, ...] as rows: K (or the latent) of (block,
        # offset) at block * entries * block_size + offset, its V block_size rows further.
        return slot_mapping // self.block_size * (self.entries - 1) * self.block_size + slot_mapping

    def write_kv(
        self, k, v, kv_layer, k_rows: torch.Tensor, v_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the step's K and V (or latent) rows into the layer's pool; returns its K and V
        pages, [num_blocks, block_size, kv_heads, head_dim] views."""
        # index_copy_ of whole rows: ~4.5x faster than an index_put with block and offset indices
        rows = kv_layer.view(-1, k.shape[1] * k.shape[2])
        rows.index_copy_(0, k_rows, k.reshape(k.shape[0], -1))
        k_pages = kv_layer[:, 0]
        if self.latent_v_dim:  # the latent is both: V is its first columns
            return k_pages, k_pages[..., : self.latent_v_dim]
        rows.index_copy_(0, v_rows, v.reshape(v.shape[0], -1))
        return k_pages, kv_layer[:, 1]
