"""Proportional back-off for one path to a KV store: a worker keeps one for its loads and one
for its writes, so a failing write never costs a load, nor the reverse.

- A failure skips the path for `FIRST_SKIP_S`; each further failure in a row doubles the skip,
  up to `MAX_SKIP_S`. A success ends the run of failures: the next skip is `FIRST_SKIP_S` again.
- Calls already in flight when a failure is counted belong to the same incident: their own
  failures do not double the skip again (ten loads that ran into one pause are one failure).
- So one slow call costs that path a fraction of a second, and a dead or paused store costs at
  most one deadline per back-off period once the skip has grown (`MAX_SKIP_S`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from services.worker import metrics

log = logging.getLogger(__name__)
FIRST_SKIP_S = 0.25
MAX_SKIP_S = 10.0


class Backoff:
    def __init__(self, call: str, what: str, clock: Callable[[], float] = time.monotonic):
        """`call`: the metrics' label (load | store); `what`: the path in words, for the log."""
        self.call, self.what, self.clock = call, what, clock
        self.num_failures = 0  # in a row, one per incident
        self.failed_at = float("-inf")
        self.skip_until = float("-inf")

    def available(self) -> bool:
        """Whether a call may go now; its start time is `self.clock()` read before it."""
        return self.clock() >= self.skip_until

    def succeeded(self) -> None:
        self.num_failures = 0

    def failed(self, started_at: float, exc: BaseException) -> None:
        """A call that started at `started_at` (`self.clock()`) failed with `exc`."""
        metrics.count_store_failure(self.what, exc)
        if started_at <= self.failed_at:
            return  # it was in flight when this incident was counted
        now = self.clock()
        self.num_failures += 1
        skip_s = min(FIRST_SKIP_S * 2 ** (self.num_failures - 1), MAX_SKIP_S)
        self.failed_at, self.skip_until = now, now + skip_s
        metrics.KV_STORE_BACKOFFS.labels(self.call).inc()
        log.warning(
            "KV store: %s failed (%d in a row: %s); skipped for %.2fs",
            self.what,
            self.num_failures,
            exc,
            skip_s,
        )
