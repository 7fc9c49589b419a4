"""Continuous batching with a per-step token budget, chunked prefill and preemption.

Each step:
1. Running sequences first, oldest first: a decoding sequence needs one token, a sequence
   part-way through its prompt takes the next chunk (up to what is left of the budget). If
   the pool cannot hold a sequence's new KV, the newest running sequence is preempted: its
   blocks are freed (full blocks stay in the prefix cache) and it goes back to the head of
   the waiting queue, to be recomputed later. Never a crash, never a wait for memory.
2. Then, unless something was preempted this step, waiting sequences join in arrival order
   while the budget, `max_num_seqs` and free blocks allow, each reusing its cached prefix.

A sequence samples a token in a step when that step computes its last known token.

Speculation: a decoding sequence may bring draft tokens (`schedule(drafts)`). They ride
after its last token in the same step, as far as the token budget and the pool allow; a
draft is dropped before anything is preempted for it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # draft tokens included
    spec_token_ids: list[list[int]] = field(default_factory=list)  # each sequence's drafts this step
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


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose blocks are already allocated and computed (imported KV)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: Optional[dict[str, list[int]]] = None) -> ScheduledBatch:
        """`drafts`: draft tokens by request id, for decoding sequences."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
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

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED) -> None:
        """Take a sequence out of the queues. Blocks are freed unless it is PREFILLED (held for export)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if status is SequenceStatus.FINISHED:
            self.blocks.free(seq)
        seq.status = status
