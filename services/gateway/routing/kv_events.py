"""Keeps the prefix index in step with every worker's KV events.

One task per worker streams its `KVEvents`: the first batch is a snapshot, which replaces all
the index knew of that worker; later batches must follow on without a gap in their numbers.
A gap, a new incarnation (the worker restarted), a broken stream, a failed health check or
the worker leaving the set drops all of that worker's entries at once, so no request is ever
routed on a dead or restarted worker's old blocks; the task then resubscribes (a fresh
snapshot) every `retry_s` while the worker is in the set (event_feed.py).
"""

from __future__ import annotations

import asyncio

from services.gateway.routing.event_feed import Numbering, follow
from services.gateway.routing.prefix_index import PrefixIndex
from tandem.v1 import worker_pb2


class KVEventFeeds:
    def __init__(self, index: PrefixIndex, retry_s: float = 0.5):
        self.index = index
        self.retry_s = retry_s
        self._tasks: dict[object, asyncio.Task] = {}

    def watch(self, endpoint) -> None:
        """Starts following `endpoint`'s events (a worker that joined the set)."""
        if endpoint not in self._tasks:
            self._tasks[endpoint] = asyncio.create_task(
                follow(
                    f"KV events of {endpoint.address}",
                    lambda numbering: self._stream(endpoint, numbering),
                    lambda: self.index.drop(endpoint),
                    self.retry_s,
                ),
                name=f"kv-events {endpoint.address}",
            )

    def resync(self, endpoint) -> None:
        """Drops its blocks and subscribes afresh (it stopped answering health checks): the
        new stream's snapshot restores them once it answers again."""
        self.forget(endpoint)
        self.watch(endpoint)

    def forget(self, endpoint) -> None:
        """Stops following it and drops its blocks (it left the set)."""
        task = self._tasks.pop(endpoint, None)
        if task is not None:
            task.cancel()
        self.index.drop(endpoint)

    async def _stream(self, endpoint, numbering: Numbering) -> None:
        call = endpoint.worker.KVEvents(worker_pb2.KVEventsRequest())
        try:
            async for batch in call:
                if numbering.check(
                    batch.incarnation, batch.first_seq, batch.snapshot, len(batch.events)
                ):
                    self.index.drop(endpoint)
                for event in batch.events:
                    if event.evicted:
                        self.index.evicted(endpoint, event.block_hashes)
                    else:
                        self.index.stored(endpoint, event.block_hashes)
        finally:
            call.cancel()

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
