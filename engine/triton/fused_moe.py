"""A mixture of experts' routed experts in two Triton matmuls over the tokens sorted by expert,
with no value read back to the host, so a CUDA graph captures the whole layer.

The (token, slot) pairs a router chose are grouped by expert, each expert's run padded to a
multiple of BLOCK_M rows (`sort_pairs`, in torch ops of fixed shapes: the padded length is at
most pairs + experts x (BLOCK_M - 1)). Each program of `_expert_matmul` takes one block of rows,
all of one expert, and one tile of that expert's outputs: gate/up over the tokens' hidden
states, then down over the pairs' activations, times the routing weight. A token's pairs are
then added in slot order. Blocks past the used length stop at once. The experts' weights are
stacked [experts, out, in] in their published form (bf16, FP8 blocks or INT4 groups: the tiles
are dequantized as engine/triton/quantized_matmul.py does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.layers.mlp import silu_and_mul
from engine.layers.quantized import QUANTIZED
from engine.triton import WIDEN_DOT_OPERANDS
from engine.triton.quantized_matmul import weight_operands, weight_tile

BLOCK_N, BLOCK_K = 64, 128


@triton.jit
def _expert_matmul(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    pairs_ptr,
    block_expert_ptr,
    used_ptr,
    routing_ptr,
    num_pairs,
    cols,
    inputs,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    stride_om,
    TOP_K: tl.constexpr,
    BY_TOKEN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    KIND: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
):
    block = tl.program_id(0)
    if block * BLOCK_M >= tl.load(used_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    row = pair // TOP_K if BY_TOKEN else pair  # gate/up reads the pair's token, down the pair
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, inputs, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + row[:, None] * stride_xm + k[None, :],
            mask=valid[:, None] & (k[None, :] < inputs),
            other=0.0,
        )
        inside = (n[:, None] < cols) & (k[None, :] < inputs)
        w = weight_tile(
            w_ptr + expert * stride_we,
            s_ptr + expert * stride_se,
            n,
            k,
            inside,
            stride_wn,
            stride_sn,
            stride_sk,
            KIND,
            GROUP,
        ).to(x.dtype)
        if WIDEN:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if WEIGHTED:
        acc *= tl.load(routing_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(
        out_ptr + pair[:, None] * stride_om + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=valid[:, None] & (n[None, :] < cols),
    )


def sort_pairs(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (pairs [padded]: flat pair indices grouped by expert, each expert's run padded
    to a multiple of block_m with T * k; the expert of each block of block_m; the used length
    [1]), of fixed shapes and with no host read."""
    flat = ids.flatten()
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert]
    capacity = num_pairs + num_experts * (block_m - 1)
    pairs = torch.full((capacity,), num_pairs, dtype=torch.long, device=ids.device)
    pairs[(ends - padded)[expert] + rank] = order
    starts = torch.arange(0, capacity, block_m, device=ids.device)
    block_expert = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return pairs, block_expert, ends[-1:]


def _stacked(weights: list) -> tuple[int, torch.Tensor, torch.Tensor, int] | None:
    """Experts' weights of one kind stacked [experts, ...] for weight_tile; None if they differ."""
    parts = [weight_operands(w) for w in weights]
    if len({(kind, data.shape, scale.shape, group) for kind, data, scale, group in parts}) != 1:
        return None
    kind, _, _, group = parts[0]
    return kind, torch.stack([p[1] for p in parts]), torch.stack([p[2] for p in parts]), group


class FusedExperts:
    def __init__(self, gate_up: tuple, down: tuple):
        self.gate_up, self.down = gate_up, down
        self.num_experts = gate_up[1].shape[0]

    @staticmethod
    def of(experts) -> FusedExperts | None:
        """From a layer's GatedMLPs whose Linears keep their weight (dense or quantized), stacked;
        None where a Linear holds only a CPU kernel's packing, or the experts differ."""
        gate_up = [e.gate_up_proj.weight for e in experts]
        down = [e.down_proj.weight for e in experts]
        if any(not isinstance(w, (torch.Tensor, *QUANTIZED)) for w in gate_up + down):
            return None
        stacked = _stacked(gate_up), _stacked(down)
        if None in stacked:
            return None
        return FusedExperts(*stacked)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], the routing's weights and expert ids [T, k] -> the routed sum [T, hidden]."""
        tokens, top_k = ids.shape
        block_m = 16 if tokens * top_k <= 64 * self.num_experts else 64
        sorted_pairs = sort_pairs(ids, self.num_experts, block_m)
        hidden = self._matmul(x, self.gate_up, sorted_pairs, tokens * top_k, top_k, block_m, None)
        routing = weights.flatten().float().contiguous()
        act = silu_and_mul(hidden)
        out = self._matmul(act, self.down, sorted_pairs, tokens * top_k, top_k, block_m, routing)
        return out.view(tokens, top_k, -1).sum(dim=1)  # a token's experts, in slot order

    def _matmul(self, x, stacked, sorted_pairs, num_pairs, top_k, block_m, routing):
        kind, data, scale, group = stacked
        pairs, block_expert, used = sorted_pairs
        if x.stride(-1) != 1:
            x = x.contiguous()
        cols = data.shape[1]
        inputs = x.shape[1]
        out = x.new_empty(num_pairs, cols)
        grid = (block_expert.shape[0], triton.cdiv(cols, BLOCK_N))
        _expert_matmul[grid](
            x,
            data,
            scale,
            out,
            pairs,
            block_expert,
            used,
            routing if routing is not None else out,
            num_pairs,
            cols,
            inputs,
            x.stride(0),
            data.stride(0),
            data.stride(1),
            scale.stride(0),
            scale.stride(1),
            scale.stride(2),
            out.stride(0),
            TOP_K=top_k,
            BY_TOKEN=routing is None,
            WEIGHTED=routing is not None,
            KIND=kind,
            GROUP=group,
            BLOCK_M=block_m,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            PRECISION="ieee" if x.dtype == torch.float32 or WIDEN_DOT_OPERANDS else "tf32",
            WIDEN=WIDEN_DOT_OPERANDS,
        )
        return out
