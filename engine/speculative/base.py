"""The drafter contract: propose up to k next tokens for each sequence of a batch.

A drafter only guesses; the target model verifies every guess in the same forward pass as
the rest of the batch (engine/speculative/verify.py), so a bad guess costs compute, never
correctness. A draft may carry the distribution each token was drawn from (q, over a few of
the target's token ids: draw.py) for rejection sampling; without it the draft counts as
certain (a one-hot proposal: prompt lookup, predicted outputs, a model's argmax).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from engine.sequence import Sequence


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    # [len(token_ids), N] long: target ids, each token's q's support
    q_ids: torch.Tensor | None = None
    q: torch.Tensor | None = None  # [len(token_ids), N] float32: their probabilities; None: one-hot

    def dense_q(self, n: int, vocab_size: int) -> torch.Tensor:
        """q of the first n tokens over the whole vocabulary, [n, vocab_size]."""
        return torch.zeros(n, vocab_size, device=self.q.device).scatter_(
            -1, self.q_ids[:n], self.q[:n]
        )

    @staticmethod
    def from_draws(
        token_ids: list[int], draws: list[tuple[torch.Tensor, torch.Tensor] | None]
    ) -> Draft:
        """A draft from draw.draw's rows for its tokens (all drawn from q, or none)."""
        if not draws or draws[0] is None:
            return Draft(token_ids)
        return Draft(
            token_ids, torch.stack([ids for ids, _ in draws]), torch.stack([q for _, q in draws])
        )


class Drafter(ABC):
    # The target layers whose inputs this drafter drafts from (EAGLE-3); the engine then hands
    # it those hidden states for every position a step verified, through `add_features`.
    aux_layers: tuple[int, ...] = ()

    @abstractmethod
    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        """At most `max_tokens[i]` tokens to follow `seqs[i].token_ids` (fewer or none is fine)."""

    def add_features(self, seq: Sequence, start: int, aux: torch.Tensor) -> None:
        """The target verified positions start.. of `seq`; `aux`: its hidden states there at
        `aux_layers`, [positions, len(aux_layers) x hidden]."""

    def forget(self, request_id: str) -> None:
        """The request is gone: drop any state kept for it."""
