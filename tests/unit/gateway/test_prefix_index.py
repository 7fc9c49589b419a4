"""The prefix index and the KV event feeds that keep it: snapshot on connect, numbered events,
a gap or a restart drops the worker's entries and resubscribes."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

from services.gateway.routing.kv_events import KVEventFeeds
from services.gateway.routing.prefix_index import PrefixIndex
from tandem.v1 import worker_pb2


def test_match_counts_each_workers_leading_cached_blocks():
    index = PrefixIndex()
    index.stored("a", [1, 2, 3])
    index.stored("b", [1, 2])
    index.stored("c", [2, 3])  # not a prefix: block 1 is missing
    assert index.match([1, 2, 3, 4], ["a", "b", "c", "d"]) == {"a": 3, "b": 2, "c": 0, "d": 0}
    index.evicted("a", [2])
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}
    index.drop("b")
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 0}
    assert len(index) == 3  # hashes 1 and 3 (a), 2 and 3 (c)
    index.stored("e", [9])  # the freed slot is reused without mixing workers up
    assert index.match([9], ["a", "c", "e"]) == {"a": 0, "c": 0, "e": 1}


def test_num_blocks_of_counts_each_workers_blocks_once_as_events_arrive():
    index = PrefixIndex()
    index.stored("a", [1, 2, 3])
    index.stored("a", [2, 3, 4])  # 2 and 3 again: a block is counted once
    index.stored("b", [1])
    index.evicted("a", [1, 9])  # 9 was never held
    assert (index.num_blocks_of("a"), index.num_blocks_of("b")) == (3, 1)
    index.drop("a")
    index.stored("c", [5])  # takes a's freed slot
    assert [index.num_blocks_of(w) for w in "abc"] == [0, 1, 1]


def test_memory_per_million_blocks_is_about_a_hundred_megabytes():
    index = PrefixIndex()
    index.stored("a", range(1 << 40, (1 << 40) + 200_000))
    per_block = (
        sys.getsizeof(index._holders) + sum(sys.getsizeof(h) for h in index._holders)
    ) / 200_000
    # bytes: the dict slot and the 64-bit key (the mask is a cached small int)
    assert per_block < 150


@dataclass
class FakeWorker:
    """A worker's KVEvents stream, scripted: one list of batches per subscription."""

    streams: list[list[worker_pb2.KVEventBatch]]
    subscriptions: int = 0

    def KVEvents(self, request):
        batches = self.streams[min(self.subscriptions, len(self.streams) - 1)]
        self.subscriptions += 1
        return FakeCall(batches)


class FakeCall:
    def __init__(self, batches):
        self.batches = batches

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        for batch in self.batches:
            yield batch
        await asyncio.sleep(3600)  # an open stream

    def cancel(self):
        pass


@dataclass(eq=False)
class FakeEndpoint:
    worker: FakeWorker
    address: str = "w"


def batch(first_seq, stored=(), evicted=(), snapshot=False, incarnation="i1"):
    events = [worker_pb2.KVEvent(block_hashes=list(stored))] if stored or snapshot else []
    if evicted:
        events.append(worker_pb2.KVEvent(evicted=True, block_hashes=list(evicted)))
    return worker_pb2.KVEventBatch(
        incarnation=incarnation, first_seq=first_seq, snapshot=snapshot, events=events
    )


async def follow(streams, settle_s: float = 0.05):
    index, endpoint = PrefixIndex(), FakeEndpoint(FakeWorker(streams))
    feeds = KVEventFeeds(index, retry_s=0.01)
    feeds.watch(endpoint)
    await asyncio.sleep(settle_s)
    return index, endpoint, feeds


def test_snapshot_then_numbered_events_build_the_workers_entries():
    async def scenario():
        index, endpoint, feeds = await follow(
            [[batch(5, [1, 2], snapshot=True), batch(5, [3]), batch(6, [4], [1])]]
        )
        # 1 was evicted: the chain breaks at once
        assert index.match([1, 2], [endpoint]) == {endpoint: 0}
        assert index.match([2], [endpoint]) == {endpoint: 1}
        assert index.num_blocks_of(endpoint) == 3 and endpoint.worker.subscriptions == 1
        feeds.close()

    asyncio.run(scenario())


def test_a_gap_in_the_numbers_drops_everything_and_resubscribes():
    async def scenario():
        # events 1-4 never came
        first = [batch(0, [1, 2], snapshot=True), batch(0, [3]), batch(5, [9])]
        again = [batch(7, [1, 2, 3, 9], snapshot=True)]
        index, endpoint, feeds = await follow([first, again])
        assert endpoint.worker.subscriptions == 2
        assert index.match([1, 2, 3, 9], [endpoint]) == {endpoint: 4}  # the fresh snapshot, whole
        feeds.close()

    asyncio.run(scenario())


def test_a_restarted_worker_and_a_departed_one_leave_no_entries():
    async def scenario():
        old = [batch(0, [1, 2], snapshot=True), batch(0, [3], incarnation="i1")]
        restarted = [batch(0, [], snapshot=True, incarnation="i2"), batch(0, [8], incarnation="i2")]
        index, endpoint, feeds = await follow([old + [batch(1, [4], incarnation="i2")], restarted])
        assert index.match([1], [endpoint]) == {endpoint: 0} and index.match([8], [endpoint]) == {
            endpoint: 1
        }
        assert index.num_blocks_of(endpoint) == 1
        feeds.forget(endpoint)
        assert len(index) == 0

    asyncio.run(scenario())
