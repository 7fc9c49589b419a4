"""Large steps also compute on CPUs the engine borrows; the others stay on its own.

A served worker computes on CPUs of its own and leaves the first CPU to its front end (the
gateway, Envoy and the clients: deploy/stack.py place_workers). The front end idles while
prompts wait for their first token, so a step borrows, running an OpenMP thread on each
borrowed CPU, when it is
- a wave of prompts: at least `min_tokens` (measured on 2 vCPUs: 64 prompts of 256 tokens
  prefilled 1.55-1.68x faster on two threads than on one);
- or prompts alone, with nothing streaming: no sequence in it has an output yet, and at least
  IDLE_FRONT_END_TOKENS (a lone prompt of 64, 128 or 256 tokens: 1.44-1.6x faster).
Other steps (decode, when the front end streams every token) stay on the engine's own CPUs,
where a helper descheduled by the front end cannot hold up a parallel region's barrier. The
bits are the same either way: the kernels split rows and columns, never a sum
(tests/unit/test_invariance.py).
"""

from __future__ import annotations

import logging

import torch

from engine.cpu import pin_threads, thread_ids

log = logging.getLogger(__name__)

IDLE_FRONT_END_TOKENS = 64


class StepThreads:
    """Called by the thread that runs the engine's steps (OpenMP keeps a pool per such thread)."""

    def __init__(self, own: int, borrowed: list[int], min_tokens: int):
        self.own, self.borrowed, self.min_tokens = own, borrowed, min_tokens
        self._current = 0
        self._helpers: set[int] | None = None  # the borrowed CPUs' OpenMP threads, once made

    def fit(self, num_tokens: int, streaming: bool = True) -> None:
        """Sets this step's thread count from its token count (drafts left out) and whether any
        of its sequences streams (has an output already)."""
        borrow = num_tokens >= self.min_tokens or (
            not streaming and num_tokens >= IDLE_FRONT_END_TOKENS
        )
        wanted = self.own + len(self.borrowed) if borrow else self.own
        if wanted == self._current:
            return
        if wanted > self.own and self._helpers is None:
            self._helpers = self._make_helpers()
        torch.set_num_threads(wanted)
        self._current = wanted

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
