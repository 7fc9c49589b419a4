"""Large steps also compute on CPUs the engine borrows; the others stay on its own.

A served worker computes on CPUs of its own and leaves the first CPU to its front end (the
gateway, Envoy and the clients: deploy/stack.py place_workers). The front end's share is small
(SmolLM2 under an agent workload at 16: 0.5 ms of CPU an output token, against a 10 ms step),
so a step borrows, running an OpenMP thread on each borrowed CPU, when it is
- a wave of prompts: at least `min_tokens` (measured on 2 vCPUs: 64 prompts of 256 tokens
  prefilled 1.55-1.68x faster on two threads than on one);
- or any step with prompt tokens in it, of at least PROMPT_STEP_TOKENS (a lone prompt of 64,
  128 or 256 tokens: 1.44-1.6x faster; an agent's next turn, ~300 tokens beside 10 decodes,
  took 1.1 s on one thread, 24% of the engine's time at 16 agents, until these borrowed too).
Decode steps, while the front end streams every token, borrow where that is learned to pay.
A helper descheduled by the front end holds up each parallel region's barrier, so on a tiny
model (the demo: 1.6 ms a step at 600 tok/s, the front end busy) its own CPU is faster; on a
30-layer one (SmolLM2: 18 ms a step on one thread, 9.7 on two, 60-100 tok/s to stream) the
lent CPU is mostly idle and nearly halves the step. Which holds depends on the model, the batch
and the front end's load, so a LengthTuner over "caps" 0 (own CPUs) and 1 (borrow) learns it per
batch-size bucket from the decode steps' own output tokens per second, each bucket starting
from borrowing. Its turns last TURN_STEPS steps: any two steps in a row then hold one of each
of the speculation tuner's alternating caps, and that tuner's pairs see both thread counts
alike, so neither learns the other's choice. Smaller steps with prompt tokens stay on the
engine's own CPUs.
The bits are the same either way: the kernels split rows and columns, never a sum
(tests/unit/test_invariance.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.cpu import pin_threads, thread_ids
from engine.speculative.tuner import LengthTuner

log = logging.getLogger(__name__)

PROMPT_STEP_TOKENS = 64
TURN_STEPS = 2


@dataclass
class _Turn:
    """Decode steps run under one choice of the tuner's, recorded to it as one."""

    batch_size: int
    borrow: bool
    num_steps: int = 0
    num_tokens: int = 0
    seconds: float = 0.0


class StepThreads:
    """Called by the thread that runs the engine's steps (OpenMP keeps a pool per such thread)."""

    def __init__(self, own: int, borrowed: list[int], min_tokens: int):
        self.own, self.borrowed, self.min_tokens = own, borrowed, min_tokens
        self._current = 0
        self.decode_tuner = LengthTuner(1, start_high=True)  # 0: own CPUs, 1: borrow
        self._turn: _Turn | None = None
        self._helpers: set[int] | None = None  # the borrowed CPUs' OpenMP threads, once made

    def fit(self, num_tokens: int, decode_batch: int = 0) -> None:
        """Sets this step's thread count from its token count (drafts left out) and, for a
        step of decodes alone, their number (`decode_batch`; then `record` its outcome)."""
        borrow = num_tokens >= self.min_tokens or (
            not decode_batch and num_tokens >= PROMPT_STEP_TOKENS
        )
        if not borrow and decode_batch:
            if self._turn is None:
                cap = self.decode_tuner.choose(decode_batch)
                self._turn = _Turn(decode_batch, borrow=cap == 1)
            borrow = self._turn.borrow
        wanted = self.own + len(self.borrowed) if borrow else self.own
        if wanted == self._current:
            return
        if wanted > self.own and self._helpers is None:
            self._helpers = self._make_helpers()
        torch.set_num_threads(wanted)
        self._current = wanted

    def record(self, num_tokens: int, seconds: float) -> None:
        """A decode step fitted with `decode_batch` produced `num_tokens` in `seconds`."""
        turn = self._turn
        if turn is None:
            return
        turn.num_steps += 1
        turn.num_tokens += num_tokens
        turn.seconds += seconds
        if turn.num_steps == TURN_STEPS:
            self.decode_tuner.record(
                turn.batch_size, int(turn.borrow), turn.num_tokens, turn.seconds
            )
            self._turn = None

    def _make_helpers(self) -> set[int]:
        """Grows this thread's OpenMP pool by one thread a borrowed CPU and pins those threads
        there (threads start on their creator's CPUs). libgomp keeps a pool's threads in order,
        so the same ones serve every larger team after."""
        torch.set_num_threads(self.own)
        self._spin_up()
        before = thread_ids()
        torch.set_num_threads(self.own + len(self.borrowed))
        self._spin_up()
        helpers = thread_ids() - before
        pin_threads(helpers, self.borrowed)
        log.info(
            "large steps (>= %d tokens) also compute on borrowed CPUs %s",
            self.min_tokens,
            self.borrowed,
        )
        return helpers

    @staticmethod
    def _spin_up() -> None:
        """One parallel region over every thread of the current count."""
        torch.ones(1 << 20).mul_(2)
