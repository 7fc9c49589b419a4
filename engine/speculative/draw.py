"""How a model drafter (a draft model, an EAGLE-3 head) picks each draft token.

- **Greedy requests, and sampled requests with a seed**: the draft's argmax, a one-hot
  proposal. The target checks it against its own draw for that output index (verify.py), so
  the output is token for token what plain decoding gives: a seed reproduces whatever was
  drafted and however many tokens the tuner let through.
- **Sampled requests without a seed** have no output to reproduce. Their drafts are drawn from
  q, the draft's distribution under the request's own temperature and filters, cut to its
  TOP_Q most likely tokens (so q travels as a few numbers a token), and verified by rejection
  sampling, which keeps a draft with probability min(1, p/q) rather than p: more drafts kept
  where target and draft agree on a spread-out distribution.

The draws are a pure function of (the request's seed, the token's position), in a stream apart
from the sampler's, so the draft service draws what an in-process drafter would.
"""

from __future__ import annotations

import torch

from engine.sampler import SamplingBatch, filter_logits, uniform_noise
from engine.sequence import Sequence

TOP_Q = 16
DRAFT_STREAM = 0x2545F491  # seeds + this: the draft's noise


def draws_with_q(seq: Sequence) -> bool:
    return not seq.params.greedy and seq.params.seed is None


def draw(
    logits: torch.Tensor, seqs: list[Sequence], positions: list[int]
) -> tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """logits [B, V]: the draft's next-token logits for the requests `seqs` (row order), at the
    sequence positions `positions`. Returns a token per row [B] (ids of `logits`' vocabulary) and,
    for rows drawn from q, row -> (q's token ids [N], q [N] float32)."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, seq in enumerate(seqs) if draws_with_q(seq)]
    if not rows:
        return tokens, {}
    sub = [seqs[i] for i in rows]
    batch = SamplingBatch.from_sequences(sub, logits.shape[-1], logits.device)
    top = filter_logits(logits[rows].float(), batch).topk(min(TOP_Q, logits.shape[-1]), dim=-1)
    q = top.values.softmax(dim=-1)  # filtered-out tokens have probability 0
    steps = torch.tensor([positions[i] for i in rows], dtype=torch.int64, device=logits.device)
    gumbel = -torch.log(-torch.log(uniform_noise(batch.seeds + DRAFT_STREAM, steps, q.shape[-1])))
    choice = (q.log() + gumbel.float()).argmax(dim=-1, keepdim=True)
    tokens[rows] = top.indices.gather(-1, choice).squeeze(-1)
    return tokens, {row: (top.indices[j], q[j]) for j, row in enumerate(rows)}
