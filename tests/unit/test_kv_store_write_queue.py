"""A worker's pending write-throughs (services/worker/write_queue.py): bounded, shed oldest
first, drained by a bounded number of writers, and `put` never waits."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.worker.write_queue import WriteQueue


class Writes:
    """A store that takes writes only when the test lets it."""

    def __init__(self):
        self.started: list[str] = []
        self.done: list[str] = []
        self.running = self.most_running = 0
        self.go = asyncio.Event()

    async def write(self, item: str) -> None:
        self.started.append(item)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await self.go.wait()
            if item == "bad":
                raise RuntimeError("the store refused it")
            self.done.append(item)
        finally:
            self.running -= 1


def test_a_full_queue_drops_its_oldest_write_and_counts_it():
    async def run():
        writes, dropped = Writes(), []
        queue = WriteQueue(writes.write, max_pending=2, num_writers=1, on_drop=dropped.append)
        queue.put("a")
        await asyncio.sleep(0)  # the writer takes "a" and waits on the store
        for item in "bcd":
            queue.put(item)
        assert dropped == ["b"] and queue.num_dropped == 1 and queue.num_pending == 2
        writes.go.set()
        await queue.join()
        await queue.close()
        return writes.done

    assert asyncio.run(run()) == ["a", "c", "d"]


def test_put_never_waits_on_a_store_that_takes_nothing():
    async def run():
        writes = Writes()
        queue = WriteQueue(writes.write, max_pending=8, num_writers=2)
        queue.put("first")
        queue.put("second")
        await asyncio.sleep(0.01)  # both writers wait on the store
        started = time.perf_counter()
        for i in range(10_000):
            queue.put(str(i))
        elapsed = time.perf_counter() - started
        await asyncio.sleep(0.01)
        state = queue.num_pending, queue.num_dropped, writes.most_running
        await queue.close()
        return elapsed, state

    elapsed, (num_pending, num_dropped, most_running) = asyncio.run(run())
    # the two writers hold "first" and "second"; the eight newest are queued; the rest shed
    assert (num_pending, num_dropped, most_running) == (8, 10_000 - 8, 2)
    assert elapsed < 1.0


def test_at_most_num_writers_write_at_once_and_a_failed_write_does_not_stop_them():
    async def run():
        writes = Writes()
        queue = WriteQueue(writes.write, max_pending=100, num_writers=3)
        for item in ["bad", *map(str, range(20))]:
            queue.put(item)
        await asyncio.sleep(0.01)
        assert writes.running == 3
        writes.go.set()
        await queue.join()
        await queue.close()
        return writes

    writes = asyncio.run(run())
    assert writes.most_running == 3
    assert sorted(writes.done, key=int) == [str(i) for i in range(20)]


def test_a_queue_without_room_or_writers_is_refused():
    with pytest.raises(ValueError):
        WriteQueue(Writes().write, max_pending=0, num_writers=1)
