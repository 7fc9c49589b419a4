"""The step's sample-and-verify phase, between the forward pass and the scheduler's update:
each sampled sequence's rows of logits, masked by its grammar if it has one, drawn by the
sampler, and with drafts verified (engine/speculative/verify.py) into the tokens it keeps."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.grammar import GrammarCompiler
from engine.model_runner import StepInputs
from engine.sampler import SamplingBatch, log_softmax, sample
from engine.scheduler import SampledTokens
from engine.sequence import Sequence
from engine.speculative import Draft
from engine.speculative.verify import num_matching, rejection_sample


class StepSampler:
    def __init__(self, device: torch.device, grammars: Callable[[], GrammarCompiler]):
        """`grammars`: the engine's compiler (built on first use, by the first constrained request)."""
        self.device = device
        self.grammars = grammars

    def sample_and_verify(
        self, inputs: StepInputs, logits: torch.Tensor, drafts: dict[str, Draft]
    ) -> list[SampledTokens]:
        """Each sampled sequence's new tokens: the one drawn, or its kept drafts and one more.
        `drafts`: what each sequence's draft tokens were proposed from, by request id."""
        sampling = SamplingBatch.from_sequences(
            inputs.sample_seqs, logits.shape[-1], self.device, inputs.rows_per_seq
        )
        allowed = self._grammar_masks(inputs, logits.shape)
        tokens, logprobs, top = sample(logits, sampling, allowed)
        token_list = tokens.tolist()
        logprob_list = logprobs.tolist() if logprobs is not None else None
        # [R][k] (token id, logprob) pairs, most likely first; each request keeps its first top_logprobs.
        top_list = (
            [list(zip(ids, lps)) for lps, ids in zip(top[0].tolist(), top[1].tolist())]
            if top
            else None
        )
        sampled, row = [], 0
        for seq, count, spec in zip(inputs.sample_seqs, inputs.rows_per_seq, inputs.spec_token_ids):
            rows = slice(row, row + count)
            new, new_logprobs = _verify(
                seq,
                spec,
                drafts.get(seq.request_id),
                token_list[rows],
                logprob_list[rows] if logprob_list else None,
                logits[rows],
                allowed[rows] if allowed is not None else None,
            )
            tops = (
                [t[: seq.params.top_logprobs] for t in top_list[row : row + len(new)]]
                if top_list
                else None
            )
            sampled.append(SampledTokens(seq, new, new_logprobs, tops, len(spec)))
            row += count
        return sampled

    def _grammar_masks(self, inputs: StepInputs, shape) -> torch.Tensor | None:
        """[rows, vocab] bool: what each sampled row may draw; None when no request is constrained."""
        if all(seq.grammar is None for seq in inputs.sample_seqs):
            return None
        allowed = torch.ones(shape, dtype=torch.bool)
        row = 0
        for seq, count, spec in zip(inputs.sample_seqs, inputs.rows_per_seq, inputs.spec_token_ids):
            if seq.grammar is not None:
                allowed[row : row + count] = self.grammars().masks(seq.grammar, spec)
            row += count
        return allowed.to(self.device)


def _verify(
    seq: Sequence,
    spec: list[int],
    draft: Draft | None,
    drawn: list[int],
    drawn_logprobs: list[float] | None,
    logits: torch.Tensor,
    allowed: torch.Tensor | None,
) -> tuple[list[int], list[float] | None]:
    """The tokens a step gives `seq`, with their logprobs: the token drawn at its row, or with
    drafts (`spec`) the kept drafts and one more."""
    if not spec:
        return drawn, drawn_logprobs
    if draft.q is None or seq.params.greedy:  # the drafts the target's own draws confirm
        n = num_matching(spec, drawn) + 1
        return drawn[:n], drawn_logprobs[:n] if drawn_logprobs else None
    masked = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    new = rejection_sample(masked, seq, spec, draft.dense_q(len(spec), logits.shape[-1]))
    if drawn_logprobs:  # the last token may be a resample: its own logprob
        last = float(log_softmax(logits[len(new) - 1])[new[-1]])
        drawn_logprobs = drawn_logprobs[: len(new) - 1] + [last]
    return new, drawn_logprobs
