"""A worker's KV cache events, numbered, for the gateways' prefix indexes.

The engine records every block it registers under a hash (stored) and every cached block it
evicts. After each step the engine loop drains them into this log (so the engine's list
never grows), which numbers them without gaps and hands each batch to the subscribers on the
event loop. A subscriber first gets a snapshot, every hash cached now, taken on the engine
thread together with the number of the next event, so that batches already in the snapshot
are skipped and none is missed. A subscriber whose queue fills (it stopped reading) is
dropped; it resubscribes for a new snapshot. `incarnation` changes with every process start.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Optional

from engine.block_manager import KVEvent

MAX_QUEUED_BATCHES = 10_000  # per subscriber, before it counts as gone


@dataclass(frozen=True)
class EventBatch:
    first_seq: int
    events: list[KVEvent]
    snapshot: bool = False


class Unsubscribed(Exception):
    """The subscriber fell too far behind and was dropped."""


class KVEventLog:
    def __init__(self):
        self.incarnation = uuid.uuid4().hex
        self.next_seq = 0  # the engine thread's
        self.event_loop: Optional[asyncio.AbstractEventLoop] = None
        self._subscribers: set[asyncio.Queue] = set()

    # The engine thread.

    def record(self, events: list[KVEvent]) -> None:
        if not events:
            return
        batch = EventBatch(self.next_seq, events)
        self.next_seq += len(events)
        if self.event_loop is not None and self._subscribers:
            self.event_loop.call_soon_threadsafe(self._fan_out, batch)

    def snapshot(self, block_manager) -> EventBatch:
        return EventBatch(self.next_seq, [KVEvent("stored", tuple(block_manager.hash_to_block))], snapshot=True)

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
