"""Admission: a request that cannot start at once waits in a bounded queue, fair across keys.

The gateway admits as many requests at once as the serving workers' batches hold: the sum of
`max_num_seqs` over the healthy, non-draining workers that decode (colocated or decode role;
prefill workers queue prompts in their own engines). Beyond that a request waits here and
takes the next slot a finishing request frees, so it is routed when it can start, to
whichever worker is then least loaded.

Each API key (its name; "" without keys, so one queue, first come first served) waits in a
queue of its own, and the queues take turns by stride scheduling, weighted by the key's
`weight` (api_keys.py, default 1):
- every queue with waiters has a virtual time, `pass_`; a free slot goes to the head of the
  queue with the smallest (the one that started waiting first on a tie);
- a queue that is served advances its virtual time by 1 / weight, so a key of weight 2 gets
  two turns to another's one, and equal weights take turns round robin;
- a queue that empties is forgotten: a key that starts waiting again starts at the virtual
  time of the last turn given, with no credit saved up while it was idle, so it is next or
  nearly next, however long another key's queue is.
So a key that queues 200 requests delays another key's request by at most one turn per slot.

It is refused only when:
- the queue already holds `max_queued` requests (all keys together), and the caller's key
  has at least as many waiting as the key with the most, less one: RESOURCE_EXHAUSTED (HTTP
  429) at once. Otherwise the newest waiter of the key with the most waiting is refused in
  its place (a full queue sheds the longest queue's latest, so one key cannot fill it);
- it waited `timeout_s` without a slot: RESOURCE_EXHAUSTED (429);
- no worker is there to wait for: UNAVAILABLE (503).
Refusals carry a `Retry-After` hint. A client that goes away while queued (its task is
cancelled) leaves the queue at once. The queue metrics are labelled by key name.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import grpc

from services.gateway import metrics
from services.gateway.errors import GatewayError


class _KeyQueue:
    """One key's waiters and its virtual time in the rotation."""

    def __init__(self, pass_: float, weight: int):
        self.waiting: deque[asyncio.Future] = deque()
        self.pass_ = pass_
        self.weight = weight


class AdmissionQueue:
    def __init__(self, capacity: Callable[[], int], max_queued: int, timeout_s: float):
        self.capacity = capacity  # slots the serving workers have now
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.num_admitted = 0
        self.num_waiting = 0  # over every key
        self._queues: dict[str, _KeyQueue] = {}  # keys with waiters, in the order they came
        self._pass = 0.0  # virtual time of the last turn given

    def num_waiting_for(self, key: str) -> int:
        queue = self._queues.get(key)
        return len(queue.waiting) if queue else 0

    async def acquire(self, key: str = "", weight: int = 1) -> float:
        """Takes a slot for `key` (an API key's name), waiting for one if need be; returns the
        seconds spent queued. Every slot taken is given back with `release`."""
        capacity = self.capacity()
        if not self.num_waiting and self.num_admitted < capacity:
            self.num_admitted += 1
            metrics.QUEUE_TIME.labels(key).observe(0.0)
            return 0.0
        if capacity == 0 and not self.num_admitted:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "no healthy worker is available")
        if self.num_waiting >= self.max_queued:
            self._make_room(key)
        started = time.monotonic()
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _KeyQueue(self._pass, weight)
        queue.weight = weight  # a reloaded keys file may have changed it
        turn = asyncio.get_running_loop().create_future()
        queue.waiting.append(turn)
        self.num_waiting += 1
        self._gauge(key)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.timeout_s)
        except BaseException as exc:  # timed out, shed, or the client left (cancelled)
            if not turn.done():
                turn.cancel()
                self._leave(key, turn)
            elif not turn.cancelled() and turn.exception() is None:
                self.release()  # handed a slot just as it gave up: pass the slot on
            if isinstance(exc, asyncio.TimeoutError):
                raise GatewayError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"no worker had room within {self.timeout_s:g}s (--queue-timeout-s); retry later",
                    retry_after_s=max(1, int(self.timeout_s / 10)),
                ) from None
            raise
        waited = time.monotonic() - started
        metrics.QUEUE_TIME.labels(key).observe(waited)
        return waited

    def release(self) -> None:
        self.num_admitted -= 1
        self.wake()

    def wake(self) -> None:
        """Hands free slots to the queues' heads in turn (after a release or a change of workers)."""
        while self.num_waiting and self.num_admitted < self.capacity():
            key, queue = min(self._queues.items(), key=lambda item: item[1].pass_)
            turn = queue.waiting.popleft()
            self._pass = queue.pass_
            queue.pass_ += 1 / queue.weight
            self._left(key, queue)
            self.num_admitted += 1
            turn.set_result(None)

    def _make_room(self, key: str) -> None:
        """The queue is full: refuse the newest waiter of the key with the most waiting, unless
        that would leave `key` with as many; then refuse this request."""
        if not self._queues:  # --max-queued-requests 0
            raise _queue_full(self.max_queued)
        longest_key, longest = max(self._queues.items(), key=lambda item: len(item[1].waiting))
        if self.num_waiting_for(key) + 1 >= len(longest.waiting):
            raise _queue_full(self.max_queued)
        shed = longest.waiting.pop()
        self._left(longest_key, longest)
        shed.set_exception(_queue_full(self.max_queued))

    def _leave(self, key: str, turn: asyncio.Future) -> None:
        queue = self._queues[key]
        queue.waiting.remove(turn)
        self._left(key, queue)

    def _left(self, key: str, queue: _KeyQueue) -> None:
        """Bookkeeping after one of `key`'s waiters left its queue."""
        self.num_waiting -= 1
        if not queue.waiting:
            del self._queues[key]  # no credit kept while idle
        self._gauge(key)

    def _gauge(self, key: str) -> None:
        metrics.NUM_WAITING.labels(key).set(self.num_waiting_for(key))


def _queue_full(max_queued: int) -> GatewayError:
    return GatewayError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the request queue is full ({max_queued} waiting, --max-queued-requests); retry later",
        retry_after_s=1,
    )
