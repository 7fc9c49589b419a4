"""The drafter contract: propose up to k next tokens for each sequence of a batch.

A drafter only guesses; the target model verifies every guess in the same forward pass as
the rest of the batch (engine/speculative/verify.py), so a bad guess costs compute, never
correctness. A draft may carry the drafter's probabilities (`probs`, one row per token over
the target's vocabulary) for rejection sampling; without them the draft counts as certain
(a one-hot proposal: prompt lookup, predicted outputs, greedy draft models).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.sequence import Sequence


@dataclass
class Draft:
    token_ids: list[int] = field(default_factory=list)
    probs: Optional[torch.Tensor] = None  # [len(token_ids), vocab] float32, or None: one-hot


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
