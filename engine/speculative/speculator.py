"""Who speculates each step, how far, and from which drafter; and what was accepted.

- A request with a prediction (OpenAI's Predicted Outputs) drafts from it; the others from
  the configured drafter (`--speculative` ngram or draft, or the draft service), if any.
- k per request: up to `max_tokens` (`--num-speculative-tokens`), scaled by the request's
  recent acceptance (an exponential average of kept / proposed, starting optimistic). A
  request whose acceptance falls below MIN_ACCEPTANCE stops drafting and tries one token
  every PROBE_EVERY steps, so a request that turns predictable later is found again. k never
  passes what the request may still emit (max_tokens, the context).
- Each step's cap on the configured drafter's tokens per request comes from the tuner
  (tuner.py), which learns from the decode steps' own speed, per batch-size bucket, which cap
  gives the most output tokens per second (0, no speculation, when none pays). A prediction
  is the client's own draft, asked for: it is not capped by the tuner.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sequence import Sequence
from engine.speculative.base import Draft, Drafter
from engine.speculative.prediction import PredictionDrafter
from engine.speculative.tuner import LengthTuner

MIN_ACCEPTANCE = 0.2
PROBE_EVERY = 8
EMA = 0.3  # weight of the newest step in the acceptance average


@dataclass
class _Record:
    acceptance: float = 1.0
    steps_since_draft: int = 0


class Speculator:
    def __init__(self, drafter: Drafter | None, max_tokens: int):
        self.drafter = drafter
        self.max_tokens = max_tokens
        self.prediction = PredictionDrafter()
        self.tuner = LengthTuner(max_tokens)
        self.cap: int | None = None  # the cap of the step being run (None: nobody could draft)
        self._records: dict[str, _Record] = {}
        self.num_drafted = self.num_accepted = 0  # since start, for Health and metrics
        # (request, step) pairs that verified drafts: acceptance length = 1 + accepted / this
        self.num_verified = 0

    def propose(self, seqs: list[Sequence], limits: list[int]) -> dict[str, Draft]:
        """Drafts for decoding sequences, by request id; `limits[i]`: the most tokens seqs[i]
        may draft (what it may still emit, minus the token the step draws anyway)."""
        self.cap = None
        if not seqs or (self.drafter is None and not any(seq.params.prediction for seq in seqs)):
            return {}
        if self.drafter is not None:
            self.cap = self.tuner.choose(len(seqs))
        by_source: dict[Drafter, tuple[list[Sequence], list[int]]] = {}
        for seq, limit in zip(seqs, limits):
            source = self.prediction if seq.params.prediction else self.drafter
            if source is None:
                continue
            # A prediction is the client's own draft: it is used as far as its acceptance goes.
            cap = self.max_tokens if source is self.prediction else self.cap
            k = min(self._k(seq.request_id), cap, limit)
            if k > 0:
                group = by_source.setdefault(source, ([], []))
                group[0].append(seq)
                group[1].append(k)
        drafts = {}
        for source, (group, ks) in by_source.items():
            for seq, draft in zip(group, source.propose(group, ks)):
                if draft.token_ids:
                    drafts[seq.request_id] = draft
        return drafts

    def _k(self, request_id: str) -> int:
        record = self._records.setdefault(request_id, _Record())
        record.steps_since_draft += 1
        if record.acceptance < MIN_ACCEPTANCE:
            return 1 if record.steps_since_draft >= PROBE_EVERY else 0
        return max(1, round(self.max_tokens * record.acceptance))

    def record_step(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        """A decode step (no prompt tokens) under `cap` produced `num_tokens` in `seconds`."""
        self.tuner.record(batch_size, self.cap, num_tokens, seconds)

    def observe(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        record = self._records.setdefault(request_id, _Record())
        record.acceptance = (1 - EMA) * record.acceptance + EMA * num_accepted / num_drafted
        record.steps_since_draft = 0
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        self.num_verified += 1

    def forget(self, request_id: str) -> None:
        self._records.pop(request_id, None)
        self.prediction.forget(request_id)
        if self.drafter is not None:
            self.drafter.forget(request_id)
