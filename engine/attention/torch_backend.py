"""Plain-torch paged attention (SDPA): the CUDA fallback, the CPU backend with
`TANDEM_KERNELS=measured`, and a reference in tests (the CPU default is invariant_backend.py).

Sequences are split into groups: decodes (one query each), short queries (a decode verifying draft
tokens, a short prompt chunk: up to SHORT_QUERY) and prefills (chunks). Each group is one padded
`scaled_dot_product_attention` call over its sequences' pages gathered from the pool, with a boolean
mask for causality, context length and sliding window; a group of whole prompts (nothing cached
before them) uses SDPA's causal flag instead. Separate groups keep a long prompt's padding from
multiplying the decode and verification work. (Decode reading the pages in place, without the
gather, was measured slower on CPU: bench/README.md.)

With per-head sinks (gpt-oss) a group's softmax is SDPA's math written out, the head's sink
logit joining each row as transformers' eager attention joins it (`attend_with_sinks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionBatch
from engine.layers.kernel_choice import emulated_bf16

SHORT_QUERY = 16


@dataclass
class _Group:
    num_seqs: int
    max_query_len: int
    query_rows: torch.Tensor  # [G * Qmax] flat token index of each padded query (padding -> 0)
    valid_rows: torch.Tensor | None  # [num valid] positions in the padded layout; None: no padding
    out_rows: torch.Tensor  # [num valid] flat token index each valid output goes to
    block_tables: torch.Tensor  # [G, max_blocks]
    # [G, 1, Qmax, max_blocks * block_size] bool, True = attend; None: causal
    mask: torch.Tensor | None
    whole_batch: bool  # the group is every token in flat order: no gather, no scatter
    context_lens: torch.Tensor | None = None  # [G] of a decode group, where a backend reads it


@dataclass
class TorchAttentionMetadata:
    # [T] each new token's K row in a layer's pool viewed as [rows, kv_heads * head_dim]
    k_rows: torch.Tensor
    v_rows: torch.Tensor  # [T] ... and its V row
    groups: list[_Group]


class TorchBackend(AttentionBackend):
    def plan(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        starts, start = [], 0
        for n in batch.query_lens:
            starts.append(start)
            start += n
        decode = [i for i, n in enumerate(batch.query_lens) if n == 1]
        short = [i for i, n in enumerate(batch.query_lens) if 1 < n <= SHORT_QUERY]
        prefill = [i for i, n in enumerate(batch.query_lens) if n > SHORT_QUERY]
        groups = [
            self._plan_group(batch, starts, members)
            for members in (decode, short, prefill)
            if members
        ]
        k_rows = self.k_rows(batch.slot_mapping)
        return TorchAttentionMetadata(k_rows=k_rows, v_rows=k_rows + self.block_size, groups=groups)

    def plan_decode(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
    ) -> TorchAttentionMetadata:
        """A plan for one query per sequence from device tensors alone (slot_mapping, context_lens:
        [G]; block_tables: [G, pages]), with no host values but their shapes: a CUDA graph
        captures it (engine/cuda_graphs.py). The same values as `plan` of that batch."""
        num_seqs, pages = block_tables.shape
        kpos = torch.arange(pages * self.block_size, device=slot_mapping.device)
        mask = kpos[None, :] < context_lens[:, None]
        if self.sliding_window is not None:
            mask &= context_lens[:, None] - 1 - kpos[None, :] < self.sliding_window
        if self.chunk_size is not None:  # the last position's chunk
            last = context_lens[:, None] - 1
            mask &= kpos[None, :] >= last - last % self.chunk_size
        rows = torch.arange(num_seqs, device=slot_mapping.device)
        group = _Group(
            num_seqs=num_seqs,
            max_query_len=1,
            query_rows=rows,
            valid_rows=None,
            out_rows=rows,
            block_tables=block_tables,
            mask=mask[:, None, None, :],
            whole_batch=True,
        )
        k_rows = self.k_rows(slot_mapping)
        return TorchAttentionMetadata(
            k_rows=k_rows, v_rows=k_rows + self.block_size, groups=[group]
        )

    def _plan_group(self, batch: AttentionBatch, starts: list[int], members: list[int]) -> _Group:
        dev = self.device
        qlens = [batch.query_lens[i] for i in members]
        qmax = max(qlens)
        padded = min(qlens) != qmax
        max_blocks = max(len(batch.block_tables[i]) for i in members)
        tables = torch.tensor(
            [
                batch.block_tables[i] + [0] * (max_blocks - len(batch.block_tables[i]))
                for i in members
            ],
            dtype=torch.long,
            device=dev,
        )
        step = torch.arange(qmax, device=dev)
        first_pos = torch.tensor(
            [batch.context_lens[i] - batch.query_lens[i] for i in members], device=dev
        )
        rows = torch.tensor([starts[i] for i in members], device=dev)[:, None] + step[None, :]
        qpos = first_pos[:, None] + step[None, :]  # [G, Qmax]
        valid_rows = None
        if padded:
            valid = step[None, :] < torch.tensor(qlens, device=dev)[:, None]
            # Padded queries sit at position 0, where key 0 is always visible: no all-masked rows.
            rows, qpos = rows.where(valid, 0), qpos.where(valid, 0)
            valid_rows = valid.reshape(-1).nonzero().squeeze(1)
        # Whole prompts of one length (nothing cached before them): SDPA's own causal mask (its
        # top-left alignment is right when queries start at position 0), which lets its flash
        # kernel skip the key blocks above the diagonal (half a long prompt's work). Skipped or
        # masked, those blocks add exact zeros: the values equal the masked path's.
        causal = (
            qmax > 1
            and not padded
            and self.sliding_window is None
            and self.chunk_size is None
            and all(batch.context_lens[i] == batch.query_lens[i] for i in members)
        )
        mask = None
        if not causal:
            kpos = torch.arange(max_blocks * self.block_size, device=dev)
            mask = kpos[None, None, :] <= qpos[:, :, None]
            if self.sliding_window is not None:
                mask &= qpos[:, :, None] - kpos[None, None, :] < self.sliding_window
            if self.chunk_size is not None:  # each query's chunk
                mask &= kpos[None, None, :] >= (qpos - qpos % self.chunk_size)[:, :, None]
            mask = mask.unsqueeze(1)
        rows = rows.reshape(-1)
        return _Group(
            num_seqs=len(members),
            max_query_len=qmax,
            query_rows=rows,
            valid_rows=valid_rows,
            out_rows=rows if valid_rows is None else rows[valid_rows],
            block_tables=tables,
            mask=mask,
            whole_batch=not padded and len(members) == len(batch.query_lens),
        )

    def forward(self, q, k, v, kv_layer, meta: TorchAttentionMetadata, sinks=None):
        k_pages, v_pages = self.write_kv(k, v, kv_layer, meta.k_rows, meta.v_rows)
        if meta.groups[0].whole_batch:
            return self._attend(q, kv_layer, k_pages, v_pages, meta.groups[0], sinks)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        for g in meta.groups:
            og = self._attend(q[g.query_rows], kv_layer, k_pages, v_pages, g, sinks)
            out[g.out_rows] = og if g.valid_rows is None else og[g.valid_rows]
        return out

    def _attend(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        k_pages: torch.Tensor,
        v_pages: torch.Tensor,
        g: _Group,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: the group's padded queries [G * Qmax, heads, head_dim]; kv_layer: the layer's pool,
        k_pages and v_pages its K and V views; returns [G * Qmax, heads, v_dim]."""
        num_keys = g.block_tables.shape[1] * self.block_size
        pages = g.block_tables.reshape(-1)  # index_select gathers ~1.8x faster than indexing here
        # [G, kv_heads, keys, head_dim]: the same keys, in the same layout, whether the mask or the
        # causal flag applies, so a prompt's values do not depend on how much of it was cached.
        kg = (
            k_pages.index_select(0, pages)
            .view(g.num_seqs, num_keys, self.num_kv_heads, self.head_dim)
            .transpose(1, 2)
        )
        vg = (
            v_pages.index_select(0, pages)
            .view(g.num_seqs, num_keys, self.num_kv_heads, self.v_dim)
            .transpose(1, 2)
        )
        group = self.num_heads // self.num_kv_heads
        if g.max_query_len == 1:
            # Decode: each kv head's query heads become its query rows ([G, kv_heads, group, head_dim]),
            # so GQA needs no K/V expansion (~25% faster on CPU); every row shares the one mask row.
            qg = q.view(g.num_seqs, self.num_kv_heads, group, self.head_dim)
        else:
            qg = q.view(g.num_seqs, g.max_query_len, self.num_heads, self.head_dim).transpose(1, 2)
        if emulated_bf16(qg):  # CPU SDPA in emulated bf16 is several times slower than fp32
            qg, kg, vg = qg.float(), kg.float(), vg.float()
        if sinks is not None:
            # decode: rows of a kv head are its query heads, so its sinks run along them
            decode = g.max_query_len == 1
            og = attend_with_sinks(
                qg,
                kg if decode else kg.repeat_interleave(group, dim=1),
                vg if decode else vg.repeat_interleave(group, dim=1),
                g.mask,
                self.scale,
                sinks.view(1, self.num_kv_heads, group, 1) if decode else sinks.view(1, -1, 1, 1),
            )
        else:
            og = F.scaled_dot_product_attention(
                qg,
                kg,
                vg,
                attn_mask=g.mask,
                is_causal=g.mask is None,
                scale=self.scale,
                enable_gqa=g.max_query_len > 1 and self.num_heads != self.num_kv_heads,
            )
        if g.max_query_len == 1:
            return og.to(q.dtype).reshape(-1, self.num_heads, self.v_dim)
        return og.to(q.dtype).transpose(1, 2).reshape(-1, self.num_heads, self.v_dim)


def attend_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """softmax([q k^T * scale, sink]) without the sink's column, times v: q [G, H, Q, D], k and v
    [G, H, K, D]; mask [G, 1, Q, K] bool (True: attend), None: causal from the top left, as
    SDPA's; sinks broadcast to [G, H, Q, 1]."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v
