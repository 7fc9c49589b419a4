"""A numbered log of cache events, fanned out to subscribers on an asyncio event loop.

Shared by the workers' KV events (services/worker/kv_events.py) and the KV store's
(services/kvcache/events.py): both feed an index in the gateway that must never miss an
event. Events are numbered without gaps, so a subscriber detects a loss; a subscriber first
gets a snapshot numbered with the next event, so batches already in it are skipped. A
subscriber whose queue fills (it stopped reading) is dropped and resubscribes for a new
snapshot. `incarnation` changes with every process start: the old process's entries are gone.

`record` may be called from any thread: batches reach the subscribers through
`call_soon_threadsafe` on `event_loop`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

MAX_QUEUED_BATCHES = 10_000  # per subscriber, before it counts as gone


@dataclass(frozen=True)
class EventBatch:
    first_seq: int  # a snapshot: the number of the next event
    events: list[Any]
    snapshot: bool = False


class Unsubscribed(Exception):
    """The subscriber fell too far behind and was dropped."""


class EventLog:
    def __init__(self, event_loop: asyncio.AbstractEventLoop | None = None):
        self.incarnation = uuid.uuid4().hex
        self.next_seq = 0  # the recording thread's
        self.event_loop = event_loop
        self._subscribers: set[asyncio.Queue] = set()

    def record(self, events: list) -> None:
        if not events:
            return
        batch = EventBatch(self.next_seq, events)
        self.next_seq += len(events)
        if self.event_loop is not None and self._subscribers:
            self.event_loop.call_soon_threadsafe(self._fan_out, batch)

    def snapshot(self, events: list) -> EventBatch:
        """`events` (everything held now) numbered as of this point of the log."""
        return EventBatch(self.next_seq, events, snapshot=True)

    # The event loop.

    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(MAX_QUEUED_BATCHES)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    def _fan_out(self, batch: EventBatch) -> None:
        for queue in list(self._subscribers):
            try:
                queue.put_nowait(batch)
            except asyncio.QueueFull:
                self._subscribers.discard(queue)
                queue.get_nowait()  # room for the marker that ends its stream
                queue.put_nowait(Unsubscribed())


async def batches_after(queue: asyncio.Queue, snapshot: EventBatch) -> AsyncIterator[EventBatch]:
    """A subscriber's batches that `snapshot` does not already hold, for ever; raises
    Unsubscribed once the subscriber was dropped (it fell behind)."""
    while True:
        batch = await queue.get()
        if isinstance(batch, Unsubscribed):
            raise batch
        if batch.first_seq >= snapshot.first_seq:
            yield batch
