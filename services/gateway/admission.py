"""Admission: a request that cannot start at once waits in a bounded, fair queue.

The gateway admits as many requests at once as the serving workers' batches hold: the sum of
`max_num_seqs` over the healthy, non-draining workers that decode (colocated or decode role;
prefill workers queue prompts in their own engines). Beyond that a request waits here, first
come first served, and takes the next slot a finishing request frees, so it is routed when
it can start, to whichever worker is then least loaded. It is refused only when:
- the queue already holds `max_queued` requests: RESOURCE_EXHAUSTED (HTTP 429) at once;
- it waited `timeout_s` without a slot: RESOURCE_EXHAUSTED (429);
- no worker is there to wait for: UNAVAILABLE (503).
Refusals carry a `Retry-After` hint. A client that goes away while queued (its task is
cancelled) leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import grpc

from services.gateway import metrics
from services.gateway.errors import GatewayError


class AdmissionQueue:
    def __init__(self, capacity: Callable[[], int], max_queued: int, timeout_s: float):
        self.capacity = capacity  # slots the serving workers have now
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.num_admitted = 0
        self._waiting: deque[asyncio.Future] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self) -> float:
        """Takes a slot, waiting for one if need be; returns the seconds spent queued. Every
        slot taken is given back with `release`."""
        capacity = self.capacity()
        if not self._waiting and self.num_admitted < capacity:
            self.num_admitted += 1
            metrics.QUEUE_TIME.observe(0.0)
            return 0.0
        if capacity == 0 and not self.num_admitted:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "no healthy worker is available")
        if len(self._waiting) >= self.max_queued:
            raise GatewayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request queue is full ({self.max_queued} waiting, --max-queued-requests); "
                "retry later",
                retry_after_s=1,
            )
        started = time.monotonic()
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        metrics.NUM_WAITING.set(len(self._waiting))
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.timeout_s)
        except BaseException as exc:  # timed out, or the client left (cancelled)
            if turn.done():  # handed a slot just as it gave up: pass the slot on
                self.release()
            else:
                turn.cancel()
                self._waiting.remove(turn)
                metrics.NUM_WAITING.set(len(self._waiting))
            if isinstance(exc, asyncio.TimeoutError):
                raise GatewayError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no worker had room within {self.timeout_s:g}s (--queue-timeout-s); retry later",
                    retry_after_s=max(1, int(self.timeout_s / 10)),
                ) from None
            raise
        waited = time.monotonic() - started
        metrics.QUEUE_TIME.observe(waited)
        return waited

    def release(self) -> None:
        self.num_admitted -= 1
        self.wake()

    def wake(self) -> None:
        """Hands free slots to the longest waiters (after a release or a change of workers)."""
        while self._waiting and self.num_admitted < self.capacity():
            turn = self._waiting.popleft()
            self.num_admitted += 1
            turn.set_result(None)
        metrics.NUM_WAITING.set(len(self._waiting))
