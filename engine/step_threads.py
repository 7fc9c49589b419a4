"""Large steps also compute on CPUs the engine borrows; the others stay on its own.

A served worker computes on CPUs of its own and leaves the first CPU to its front end (the
gateway, Envoy and the clients: deploy/stack.py place_workers). A wave of prompts is
compute-bound, and the front end idles while those requests wait for their first token, so a
step of at least `min_tokens` also runs an OpenMP thread on each borrowed CPU (measured on 2
vCPUs: 64 prompts of 256 tokens prefilled 1.55-1.68x faster on two threads than on one).
Smaller steps, decode, when the front end streams every token, stay on the engine's own CPUs,
where a helper descheduled by the front end cannot hold up a parallel region's barrier. The
bits are the same either way: the kernels split rows and columns, never a sum
(tests/unit/test_invariance.py).
"""

from __future__ import annotations

import logging

import torch

from engine.cpu import pin_threads, thread_ids

log = logging.getLogger(__name__)


class StepThreads:
    """Called by the thread that runs the engine's steps (OpenMP keeps a pool per such thread)."""

    def __init__(self, own: int, borrowed: list[int], min_tokens: int):
        self.own, self.borrowed, self.min_tokens = own, borrowed, min_tokens
        self._current = 0
        self._helpers: set[int] | None = None  # the borrowed CPUs' OpenMP threads, once made

    def fit(self, num_tokens: int) -> None:
        """Sets this step's thread count from its token count."""
        wanted = self.own + len(self.borrowed) if num_tokens >= self.min_tokens else self.own
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
