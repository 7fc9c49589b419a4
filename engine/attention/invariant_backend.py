"""Batch-invariant paged attention on CPU (engine/csrc/invariant_attention.cpp): every query
token attends over the keys its position sees, in an order fixed by that token alone, so its
output is the same bits in a prompt, a cached tail, a draft verification or a decode batch of
any size, on every x86-64 CPU. The CPU default with the batch-invariant kernels
(engine/layers/kernel_choice.py); `torch` (SDPA) is the faster-prefill alternative whose values
depend on how queries are grouped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, AttentionBatch
from engine.layers import fused


@dataclass
class InvariantAttentionMetadata:
    k_rows: torch.Tensor  # [T] each new token's K row in a layer's pool (AttentionBackend.k_rows)
    v_rows: torch.Tensor  # [T] ... and its V row
    block_tables: torch.Tensor  # [seqs, max_blocks] int64
    token_seq: torch.Tensor  # [T] the sequence of each query token
    token_pos: torch.Tensor  # [T] its position: it sees keys 0..pos (or the window's)


class InvariantBackend(AttentionBackend):
    def plan(self, batch: AttentionBatch) -> InvariantAttentionMetadata:
        max_blocks = max(len(t) for t in batch.block_tables)
        tables = torch.tensor(
            [t + [0] * (max_blocks - len(t)) for t in batch.block_tables], dtype=torch.long
        )
        if all(n == 1 for n in batch.query_lens):  # decode: a token a sequence, at its end
            token_seq = torch.arange(len(batch.query_lens))
            token_pos = torch.tensor(batch.context_lens) - 1
        else:
            lens = torch.tensor(batch.query_lens)
            token_seq = torch.repeat_interleave(torch.arange(len(lens)), lens)
            starts = torch.tensor(batch.context_lens) - lens  # each sequence's first new position
            offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(
                lens.cumsum(0) - lens, lens
            )
            token_pos = starts[token_seq] + offsets
        k_rows = self.k_rows(batch.slot_mapping)
        return InvariantAttentionMetadata(
            k_rows=k_rows,
            v_rows=k_rows + self.block_size,
            block_tables=tables,
            token_seq=token_seq,
            token_pos=token_pos,
        )

    def forward(self, q, k, v, kv_layer, meta: InvariantAttentionMetadata, sinks=None):
        k_pages, v_pages = self.write_kv(k, v, kv_layer, meta.k_rows, meta.v_rows)
        return fused.OPS.paged_attention(
            q,
            k_pages,
            v_pages,
            meta.block_tables,
            meta.token_seq,
            meta.token_pos,
            -self.chunk_size if self.chunk_size else self.sliding_window or 0,
            self.scale,
            sinks,
        )
