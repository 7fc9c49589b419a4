"""Verifying drafts: which draft tokens the target keeps, and the token that follows them.

The target computes logits at the last token and at every draft token in one pass; row i
predicts the token after draft i - 1.

- **One-hot drafts** (no probabilities: prompt lookup, predicted outputs, greedy drafts). The
  target draws its own token at every row exactly as plain decoding would: the argmax for
  greedy requests, the sampler's seeded Gumbel-max draw for that output index otherwise. The
  drafts are kept up to the first one that differs from the target's token, and the target's
  token there follows (or, all kept, the bonus token after them). The output is token for
  token what plain decoding gives for the same seed: lossless by construction. A draft token
  x is kept with probability p(x), as rejection sampling with a one-hot proposal keeps it.
- **Drafts with probabilities q** on sampled requests: rejection sampling. Keep x with
  probability min(1, p(x) / q(x)) (a seeded uniform per output index, a stream apart from
  the sampler's), else draw from norm(max(0, p - q)); all kept, the bonus is drawn from p.
  p is the target's distribution after temperature and top-k/top-p/min-p.
"""

from __future__ import annotations

import torch

from engine.sampler import SamplingBatch, filter_logits, uniform_noise
from engine.sequence import Sequence

ACCEPT_STREAM = 0x5DEECE66D  # seeds + this: the acceptance uniforms, apart from the sampler's noise


def num_matching(draft: list[int], target: list[int]) -> int:
    """How many leading draft tokens equal the target's own tokens at their rows."""
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n


def rejection_sample(
    logits: torch.Tensor, seq: Sequence, draft: list[int], q: torch.Tensor
) -> list[int]:
    """logits: [d + 1, V] the target's rows; q: [d, V] the draft's probabilities. Returns the
    kept draft tokens plus one drawn token (a resample, or the bonus)."""
    d, vocab = len(draft), logits.shape[-1]
    rows = SamplingBatch.from_sequences([seq], vocab, logits.device, [d + 1])
    p = filter_logits(logits, rows).softmax(dim=-1)  # [d + 1, V]
    accept_u = uniform_noise(rows.seeds + ACCEPT_STREAM, rows.steps, 1)[:, 0]  # [d + 1] float64
    gumbel = -torch.log(-torch.log(uniform_noise(rows.seeds, rows.steps, vocab)))  # [d + 1, V]
    for i, token in enumerate(draft):
        if accept_u[i] * q[i, token] < p[i, token]:  # u < p / q without dividing by a zero q
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        if residual.sum() <= 0:  # p == q exactly: any draw from p is right
            residual = p[i]
        return draft[:i] + [int((residual.log() + gumbel[i].float()).argmax())]
    return draft + [int((p[d].log() + gumbel[d].float()).argmax())]
