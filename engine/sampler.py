"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs, top logprobs.

One set of tensor ops serves the whole batch. Randomness is a counter-based hash of
(request seed, output index, token id) rather than a stateful generator, so a request's
draws do not depend on which other requests share its batch, and a preempted request
redraws exactly what it drew before. Sampling uses the Gumbel-max trick:
argmax(logits / T + Gumbel noise) is a draw from softmax(logits / T) over the tokens the
filters keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers import fused
from engine.sequence import Sequence


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)  # logical shift on int64 (wrapping arithmetic)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float64 in (0, 1), a pure function of (seed, step, token id)."""
    row = _splitmix(seeds * _GOLDEN + steps)
    cols = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device) * _GOLDEN
    bits = _shr(_splitmix(row[:, None] + cols[None, :]), 11)
    return (bits.double() + 0.5) * 2.0**-53


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors."""

    # Row tensors are None when every row is greedy.
    temperature: torch.Tensor | None  # [B] float32, 1.0 for greedy rows
    greedy: torch.Tensor | None  # [B] bool
    top_k: torch.Tensor | None  # [B] long (vocab size = off); None when no row filters
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    seeds: torch.Tensor | None  # [B] int64
    steps: torch.Tensor | None  # [B] int64: index of the output token being drawn
    all_greedy: bool
    want_logprobs: bool
    top_logprobs: int = 0  # the batch's largest top_logprobs (0 = no row asks)

    @staticmethod
    def from_sequences(
        seqs: list[Sequence],
        vocab_size: int,
        device: torch.device,
        rows_per_seq: list[int] | None = None,
    ) -> SamplingBatch:
        """One row per sequence, or `rows_per_seq[i]` consecutive rows for sequence i: its next
        output tokens in turn (speculative verification), each drawn with its own step's noise."""
        rows_per_seq = rows_per_seq or [1] * len(seqs)
        steps_list = [s.num_output_tokens + j for s, n in zip(seqs, rows_per_seq) for j in range(n)]
        seqs = [s for s, n in zip(seqs, rows_per_seq) for _ in range(n)]
        params = [s.params for s in seqs]
        greedy = [p.greedy for p in params]
        want_logprobs = any(p.logprobs for p in params)
        top_logprobs = max(p.top_logprobs for p in params) if want_logprobs else 0
        if all(greedy):  # the common decode case: no per-row tensors to build
            return SamplingBatch(
                None, None, None, None, None, None, None, True, want_logprobs, top_logprobs
            )
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        filtered = any(k < vocab_size for k in top_k) or any(p < 1.0 for p in top_p)
        f32 = dict(dtype=torch.float32, device=device)
        return SamplingBatch(
            temperature=torch.tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params)], **f32
            ),
            greedy=torch.tensor(greedy, device=device),
            top_k=torch.tensor(top_k, device=device) if filtered else None,
            top_p=torch.tensor(top_p, **f32) if filtered else None,
            min_p=torch.tensor(min_p, **f32) if any(m > 0 for m in min_p) else None,
            seeds=torch.tensor([s.seed for s in seqs], dtype=torch.int64, device=device),
            steps=torch.tensor(steps_list, dtype=torch.int64, device=device),
            all_greedy=False,
            want_logprobs=want_logprobs,
            top_logprobs=top_logprobs,
        )


def filter_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature-scaled logits with tokens outside top-k / top-p / min-p set to -inf."""
    scaled = logits / batch.temperature[:, None]
    if batch.top_k is not None:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)
        drop = rank[None, :] >= batch.top_k[:, None]
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        drop |= (probs.cumsum(dim=-1) - probs) >= batch.top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    if batch.min_p is not None:
        probs = scaled.softmax(dim=-1)
        drop = probs < batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Over the last dim; fp32 on the CPU with the ops built, the same bits on every CPU kind
    (engine/csrc/fused_ops.cpp): torch's sums in the order of the vector width ATen picks."""
    if fused.OPS is not None and logits.device.type == "cpu" and logits.dtype == torch.float32:
        rows = logits.reshape(-1, logits.shape[-1]).contiguous()
        return fused.OPS.log_softmax(rows).view(logits.shape)
    return logits.log_softmax(dim=-1)


def sample(
    logits: torch.Tensor, batch: SamplingBatch, allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """logits: [B, V] float32; `allowed` [B, V] bool, if given: the only tokens each row may
    draw (structured outputs). Returns chosen token ids [B], if asked their logprobs [B] (under
    the model's own distribution), and if any row asks, the top-k (k = the batch's largest
    top_logprobs) as (logprobs [B, k] descending, token ids [B, k]); each row keeps its own
    first top_logprobs of them."""
    choice = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    tokens = choice.argmax(dim=-1)
    if not batch.all_greedy:
        scaled = filter_logits(choice, batch)
        gumbel = -torch.log(-torch.log(uniform_noise(batch.seeds, batch.steps, logits.shape[-1])))
        sampled = (scaled + gumbel.float()).argmax(dim=-1)
        tokens = torch.where(batch.greedy, tokens, sampled)
    logprobs = top = None
    if batch.want_logprobs:
        all_logprobs = log_softmax(logits)  # [B, V]
        logprobs = all_logprobs.gather(-1, tokens[:, None]).squeeze(1)
        if batch.top_logprobs:
            top = all_logprobs.topk(batch.top_logprobs, dim=-1)  # one topk for the batch
    return tokens, logprobs, top
