"""Paged attention for decode steps (one query a sequence), read in place from the KV pool.

One program per (sequence, KV head, chunk of that head's query heads): its query heads are
the rows of one tile, so grouped-query attention reads each K/V row once for all of them.
It walks the sequence's context in tiles of BLOCK_N positions, gathering each position's row
through the block table (any block size), with an online softmax in fp32. Multi-head latent
attention is the same walk with one KV head whose V is the first `v_dim` columns of K.

Nothing here reads a device value on the host, so a CUDA graph captures it
(engine/cuda_graphs.py); the grid is fixed by the batch's shape alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.triton import WIDEN_DOT_OPERANDS

MAX_HEADS_A_PROGRAM = 32  # query heads of one KV head a program takes (MLA has 16-128)
NO_WINDOW = 1 << 40  # a window no context reaches


@triton.jit
def _paged_decode(
    q_ptr,
    kv_ptr,
    tables_ptr,
    context_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ke,
    stride_ks,
    stride_kh,
    stride_tb,
    stride_ot,
    stride_oh,
    scale,
    window,
    GROUP: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    V_DIM: tl.constexpr,
    V_PAD: tl.constexpr,
    V_ENTRY: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    local = tl.program_id(2) * HEADS_PAD + tl.arange(0, HEADS_PAD)
    head_ok = local < GROUP
    heads = kv_head * GROUP + local
    d = tl.arange(0, HEAD_PAD)
    dv = tl.arange(0, V_PAD)
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=head_ok[:, None] & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    if WIDEN:
        q = q.to(tl.float32)
    context = tl.load(context_ptr + seq)
    first = tl.maximum(context - window, 0)  # the sliding window's first position, else 0
    best = tl.full([HEADS_PAD], float("-inf"), tl.float32)
    total = tl.zeros([HEADS_PAD], tl.float32)
    acc = tl.zeros([HEADS_PAD, V_PAD], tl.float32)
    for start in range(first // BLOCK_N * BLOCK_N, context, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        seen = (pos < context) & (pos >= first)
        page = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=seen, other=0)
        row = page.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        k = tl.load(
            kv_ptr + row[:, None] + d[None, :],
            mask=seen[:, None] & (d[None, :] < HEAD_DIM),
            other=0.0,
        )
        if WIDEN:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(seen[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        weights = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        total = total * rescale + tl.sum(weights, 1)
        v = tl.load(
            kv_ptr + row[:, None] + V_ENTRY * stride_ke + dv[None, :],
            mask=seen[:, None] & (dv[None, :] < V_DIM),
            other=0.0,
        )
        weights = weights.to(v.dtype)  # as the GPU multiplies them: in V's dtype
        if WIDEN:
            weights, v = weights.to(tl.float32), v.to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, v, input_precision=PRECISION)
        best = new_best
    out = acc / total[:, None]
    tl.store(
        out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & (dv[None, :] < V_DIM),
    )


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot wants every side at least 16


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    v_dim: int | None = None,
) -> torch.Tensor:
    """q: [G, heads, head_dim], one query a sequence at position context_lens[g] - 1 (its K/V
    already written); kv_layer: [blocks, entries, block_size, kv_heads, head_dim], entries 2
    (K, V) or 1 (a latent whose first `v_dim` columns are V); block_tables: [G, pages];
    context_lens: [G]. Returns [G, heads, v_dim or head_dim]."""
    seqs, num_heads, head_dim = q.shape
    _, entries, block_size, kv_heads, _ = kv_layer.shape
    v_dim = v_dim or head_dim
    group = num_heads // kv_heads
    heads_pad = min(_pad(group), MAX_HEADS_A_PROGRAM)
    out = q.new_empty(seqs, num_heads, v_dim)
    if q.stride(-1) != 1:
        q = q.contiguous()
    grid = (seqs, kv_heads, triton.cdiv(group, heads_pad))
    _paged_decode[grid](
        q,
        kv_layer,
        block_tables,
        context_lens,
        out,
        q.stride(0),
        q.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        sliding_window or NO_WINDOW,
        GROUP=group,
        HEADS_PAD=heads_pad,
        HEAD_DIM=head_dim,
        HEAD_PAD=_pad(head_dim),
        V_DIM=v_dim,
        V_PAD=_pad(v_dim),
        V_ENTRY=entries - 1,
        BLOCK_SIZE=block_size,
        BLOCK_N=64 if head_dim <= 128 else 32,
        PRECISION="ieee" if q.dtype == torch.float32 or WIDEN_DOT_OPERANDS else "tf32",
        WIDEN=WIDEN_DOT_OPERANDS,
    )
    return out
