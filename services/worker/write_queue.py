"""A worker's pending write-throughs to its KV store: a bounded queue drained by a bounded
number of writer tasks.

- `put` never waits: when `max_pending` writes are already queued, the oldest is dropped (and
  counted, `on_drop`) to make room: the newest prompt is the likeliest to be asked for again
  soon (a conversation's next turn).
- At most `num_writers` writes run at once, so a store slower than the offered load costs a
  bounded number of connections, threads and copies of KV, never a pile of tasks that each
  wait for the one connection and run into their deadlines together.
- A write that raises is the caller's to count (`write` should catch what it expects); the
  writer logs anything else and goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class WriteQueue(Generic[T]):
    def __init__(
        self,
        write: Callable[[T], Awaitable[None]],
        max_pending: int,
        num_writers: int,
        on_drop: Callable[[T], None] = lambda item: None,
    ):
        if max_pending < 1 or num_writers < 1:
            raise ValueError("a write queue needs room for one write and one writer")
        self.write, self.on_drop = write, on_drop
        self.num_writers = num_writers
        self.num_dropped = 0
        self._pending: asyncio.Queue[T] = asyncio.Queue(max_pending)
        self._writers: list[asyncio.Task] = []

    @property
    def num_pending(self) -> int:
        """Writes queued and not yet taken by a writer."""
        return self._pending.qsize()

    def put(self, item: T) -> None:
        """Queues `item`, dropping the oldest queued write when full. On the event loop; never waits."""
        if not self._writers:  # started on first use: a running loop is needed
            self._writers = [
                asyncio.create_task(self._drain(), name=f"kv-store-writer-{i}")
                for i in range(self.num_writers)
            ]
        if self._pending.full():
            oldest = self._pending.get_nowait()
            self._pending.task_done()
            self.num_dropped += 1
            self.on_drop(oldest)
        self._pending.put_nowait(item)

    async def join(self) -> None:
        """Waits until every queued write has been written or dropped (tests)."""
        await self._pending.join()

    async def _drain(self) -> None:
        while True:
            item = await self._pending.get()
            try:
                await self.write(item)
            except asyncio.CancelledError:
                raise
            except Exception:  # a writer never dies of one write
                log.exception("KV store: a write-through failed")
            finally:
                self._pending.task_done()

    async def close(self) -> None:
        for task in self._writers:
            task.cancel()
        await asyncio.gather(*self._writers, return_exceptions=True)
        self._writers = []
