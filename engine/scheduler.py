"""Continuous batching with a per-step token budget, chunked prefill and preemption.

Each step:
1. Running sequences first, oldest first: a decoding sequence needs one token, a sequence
   part-way through its prompt takes the next chunk (up to what is left of the budget). If
   the pool cannot hold a sequence's new KV, the newest running sequence is preempted: its
   blocks are freed (full blocks stay in the prefix cache) and it goes back to the head of
   the waiting queue, to be recomputed later. Never a crash, never a wait for memory.
2. Then, unless something was preempted this step, waiting sequences join in arrival order
   while the budget, `max_num_seqs` and free blocks allow, each reusing its cached prefix.
The budget is `max_num_batched_tokens`, or `wave_batched_tokens` while a wave of prompt
tokens (more than the smaller budget takes) is left to compute.

A sequence samples a token in a step when that step computes its last known token.

Speculation: a decoding sequence may bring draft tokens (`schedule(drafts)`). They ride
after its last token in the same step, as far as the token budget and the pool allow; a
draft is dropped before anything is preempted for it.

After the forward pass and sampling, `update_from_output` does the step's bookkeeping:
computed tokens and full blocks into the prefix cache, each sampled sequence's new tokens up
to the first that ends it, its drafts' acceptance, and its end (a prefill role's prompt ends
PREFILLED, its blocks held for export).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.outputs import RequestOutput
from engine.sequence import Sequence, SequenceStatus
from engine.speculative.speculator import Speculator
from engine.stop_checker import StopChecker


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # draft tokens included
    # each sequence's drafts this step
    spec_token_ids: list[list[int]] = field(default_factory=list)
    num_preempted: int = 0

    def add(self, seq: Sequence, n: int, spec: list[int] = ()) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.spec_token_ids.append(list(spec))

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


@dataclass
class SampledTokens:
    """What sampling (and verifying its drafts) gave one sequence in a step."""

    seq: Sequence
    token_ids: list[int]  # the token drawn; with drafts, the kept drafts and one more
    logprobs: list[float] | None  # one per token; None when the batch asked for none
    # per token, cut to the request's top_logprobs
    top_logprobs: list[list[tuple[int, float]]] | None
    num_drafted: int = 0  # draft tokens verified


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        wave_batched_tokens: int,
        stop: StopChecker,
        speculator: Speculator,
        hold_prefilled: bool = False,
    ):
        """`wave_batched_tokens`: the budget of a step while more prompt tokens are left to
        compute than `max_num_batched_tokens` takes (off unless above it). A wave's last prompt
        waits for every step before it, and each of those steps also decodes every prompt
        already through, so fewer, larger steps give it its first token sooner (on 2 vCPUs, 64
        prompts of 256 tokens: 590-623 ms at 512 a step, 490-542 at 2,048; bench/README.md),
        the wave's tail too (16 prompts of 510 with 16 tokens out: the last first token 850-950
        ms against 910-1,070 when a tail under 2,048 went in steps of 512), while the running
        sequences wait longer between tokens; an arrival that fits the smaller budget keeps it.
        `hold_prefilled` (prefill role): a request stops after its first token, PREFILLED."""
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.wave_batched_tokens = max(wave_batched_tokens, max_num_batched_tokens)
        self.stop = stop
        self.speculator = speculator
        self.hold_prefilled = hold_prefilled
        self.requests: dict[str, Sequence] = {}  # every request not yet finished or aborted
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks are already allocated and computed (imported KV)."""
        self.requests[seq.request_id] = seq
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> ScheduledBatch:
        """`drafts`: draft tokens by request id, for decoding sequences."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if (
            self.wave_batched_tokens > budget
            and self._prompt_tokens_left() > self.max_num_batched_tokens
        ):
            budget = self.wave_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            spec = drafts.get(seq.request_id, ()) if drafts and n == 1 else ()
            spec = spec[: budget - 1]
            if spec and not self.blocks.can_append(seq, 1 + len(spec)):
                spec = ()
            if spec:
                self.blocks.append(seq, 1 + len(spec))
                batch.add(seq, 1 + len(spec), spec)
                budget -= 1 + len(spec)
                i += 1
                continue
            while not self.blocks.can_append(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                self.blocks.append(seq, n)
                batch.add(seq, n)
                budget -= n
                i += 1
                continue
            break  # the sequence itself was preempted; nothing after it is left
        if batch.num_preempted:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.blocks.match_prefix(seq)
            n = min(seq.num_tokens - len(cached) * self.blocks.block_size, budget)
            if not self.blocks.can_allocate(seq, n, cached):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, n, cached)
            if not seq.num_preemptions:  # a recomputation's own blocks are not a cache hit
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        return batch

    def _prompt_tokens_left(self) -> int:
        """Prompt tokens not yet computed, waiting or partly prefilled (counted until they are
        more than the smaller budget; a waiting prompt's cached tokens counted too: a guess,
        before its prefix is matched)."""
        total = 0
        for seq in itertools.chain(self.running, self.waiting):
            total += (
                seq.num_tokens - seq.num_computed_tokens - (seq.status is SequenceStatus.RUNNING)
            )
            if total > self.max_num_batched_tokens:
                break
        return total

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update_from_output(
        self, batch: ScheduledBatch, sampled: list[SampledTokens]
    ) -> list[RequestOutput]:
        """Books a step that ran `batch` and sampled `sampled`; one output per sampled sequence."""
        for seq, n, spec in zip(batch.seqs, batch.num_new_tokens, batch.spec_token_ids):
            # a draft token's KV counts once it is verified
            seq.num_computed_tokens += n - len(spec)
            if not spec:
                self.blocks.commit_full_blocks(seq)
        return [
            self.append_tokens(s.seq, s.token_ids, s.logprobs, s.top_logprobs, s.num_drafted)
            for s in sampled
        ]

    def append_tokens(
        self,
        seq: Sequence,
        tokens: list[int],
        logprobs: list[float] | None,
        top_logprobs: list[list[tuple[int, float]]] | None,
        num_drafted: int = 0,
    ) -> RequestOutput:
        """Appends a step's tokens up to the first that ends the request. With `num_drafted`
        drafts verified, `tokens` is the kept drafts and one more: the kept drafts' KV (computed
        this step) joins the sequence's, the rejected drafts' blocks are let go.
        `top_logprobs`: per token, its top list cut to the request's top_logprobs (ignored if 0)."""
        emitted = 0
        for token in tokens:
            seq.token_ids.append(token)
            if seq.grammar is not None:
                seq.grammar.consume_token(token)
            if seq.params.logprobs:
                seq.logprobs.append(logprobs[emitted] if logprobs else None)
            emitted += 1
            self.stop.check(seq, token)
            if seq.finish_reason is not None:
                break
        if num_drafted:
            kept = min(emitted, len(tokens) - 1)
            seq.num_computed_tokens += kept
            self.blocks.commit_full_blocks(seq)
            self.blocks.trim(seq)
            seq.num_draft_tokens += num_drafted
            seq.num_accepted_draft_tokens += kept
            self.speculator.observe(seq.request_id, num_drafted, len(tokens) - 1)
        if seq.finish_reason is not None:
            self.finish(seq)
            del self.requests[seq.request_id]
            self.speculator.forget(seq.request_id)
        elif self.hold_prefilled:
            seq.finish_reason = "prefilled"
            self.finish(seq, SequenceStatus.PREFILLED)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens[:emitted],
            new_logprobs=(logprobs[:emitted] if logprobs else [None] * emitted)
            if seq.params.logprobs
            else None,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            stop_reason=seq.stop_reason,
            new_top_logprobs=top_logprobs[:emitted] if seq.params.top_logprobs else None,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_draft_tokens=seq.num_accepted_draft_tokens,
        )

    def abort(self, request_id: str) -> bool:
        """Stops a request and frees its blocks at once. False if it was unknown or already done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is SequenceStatus.PREFILLED:
            self.blocks.free(seq)
        elif not seq.is_finished:
            self.finish(seq)
        seq.finish_reason = seq.finish_reason or "abort"
        self.speculator.forget(request_id)
        return True

    def finish(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED) -> None:
        """Take a sequence out of the queues. Blocks are freed unless it is PREFILLED (held for export)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if status is SequenceStatus.FINISHED:
            self.blocks.free(seq)
        seq.status = status
