"""The admission queue on its own: slots, first come first served, bounds, deadlines, leaving,
and across API keys: a queue per key served in turn (weighted), a full queue shedding the
longest key's newest, and the waiting gauge labelled by key."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.gateway import metrics
from services.gateway.admission import AdmissionQueue
from services.gateway.errors import GatewayError


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))  # a hang guard only


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_beyond_the_slots_wait_and_start_in_arrival_order():
    async def scenario():
        queue = AdmissionQueue(lambda: 2, max_queued=10, timeout_s=10)
        started = []

        async def request(name: str, hold: asyncio.Event):
            await queue.acquire()
            started.append(name)
            await hold.wait()
            queue.release()

        holds = {name: asyncio.Event() for name in "abcde"}
        tasks = []
        for name in "abcde":
            tasks.append(asyncio.create_task(request(name, holds[name])))
            await settle()
        assert started == ["a", "b"] and queue.num_waiting == 3
        holds["b"].set()
        await settle()
        assert started == ["a", "b", "c"]
        for name in "acde":
            holds[name].set()
        await asyncio.gather(*tasks)
        assert started == list("abcde") and queue.num_admitted == 0

    run(scenario())


def test_a_full_queue_refuses_at_once_with_a_retry_hint():
    async def scenario():
        queue = AdmissionQueue(lambda: 1, max_queued=1, timeout_s=10)
        await queue.acquire()
        waiting = asyncio.create_task(queue.acquire())
        await settle()
        with pytest.raises(GatewayError) as err:
            await queue.acquire()
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.retry_after_s >= 1
        assert "queue is full" in err.value.message
        queue.release()
        await waiting  # the queued one got the slot

    run(scenario())


def test_a_wait_past_the_deadline_is_refused_and_leaves_the_queue():
    async def scenario():
        queue = AdmissionQueue(lambda: 1, max_queued=5, timeout_s=0.05)
        await queue.acquire()
        with pytest.raises(GatewayError) as err:
            await queue.acquire()
        assert (
            err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "--queue-timeout-s" in err.value.message
        )
        assert queue.num_waiting == 0 and queue.num_admitted == 1

    run(scenario())


def test_a_cancelled_waiter_leaves_at_once_and_takes_no_slot():
    async def scenario():
        queue = AdmissionQueue(lambda: 1, max_queued=5, timeout_s=10)
        await queue.acquire()
        leaving = asyncio.create_task(queue.acquire())
        staying = asyncio.create_task(queue.acquire())
        await settle()
        leaving.cancel()
        await settle()
        assert queue.num_waiting == 1
        queue.release()
        await staying
        assert queue.num_admitted == 1 and queue.num_waiting == 0

    run(scenario())


def test_no_workers_at_all_is_unavailable_not_a_wait():
    async def scenario():
        queue = AdmissionQueue(lambda: 0, max_queued=5, timeout_s=10)
        with pytest.raises(GatewayError) as err:
            await queue.acquire()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE

    run(scenario())


def test_more_slots_appearing_wake_the_waiters():
    async def scenario():
        slots = [1]
        queue = AdmissionQueue(lambda: slots[0], max_queued=5, timeout_s=10)
        await queue.acquire()
        waiters = [asyncio.create_task(queue.acquire()) for _ in range(2)]
        await settle()
        slots[0] = 3  # a worker joined
        queue.wake()
        await asyncio.gather(*waiters)
        assert queue.num_admitted == 3

    run(scenario())


def waiting_metric(key: str) -> float:
    return metrics.REGISTRY.get_sample_value("tandem:num_requests_waiting", {"key": key})


async def served_in_turn(queue: AdmissionQueue, arrivals: list[str], weights=None) -> list[str]:
    """Queues `arrivals` (key names, in that order) behind one held slot, then frees slots one
    at a time; returns the keys in the order they were admitted."""
    weights = weights or {}
    await queue.acquire("holder")
    order: list[str] = []
    tasks = []
    for key in arrivals:
        tasks.append(asyncio.create_task(queue.acquire(key, weights.get(key, 1))))
        await settle()
    for task, key in zip(tasks, arrivals):
        task.add_done_callback(lambda _, key=key: order.append(key))
    queue.release()  # the holder finishes
    while len(order) < len(arrivals):
        count = len(order)
        await settle()
        if len(order) > count:
            queue.release()  # each admitted request finishes at once, freeing the slot
    return order


def test_a_key_with_200_queued_delays_another_keys_requests_by_one_turn_each():
    async def scenario():
        queue = AdmissionQueue(lambda: 1, max_queued=1000, timeout_s=10)
        arrivals = ["a"] * 200 + ["b"] * 5
        order = []
        await queue.acquire("a")  # a's request running; 200 more of a's wait, then b's 5
        tasks = []
        for key in arrivals:
            tasks.append(asyncio.create_task(queue.acquire(key)))
            await settle()
        assert queue.num_waiting_for("a") == 200 and queue.num_waiting_for("b") == 5
        assert waiting_metric("a") == 200 and waiting_metric("b") == 5
        for task, key in zip(tasks, arrivals):
            task.add_done_callback(lambda _, key=key: order.append(key))
        for _ in range(10):  # ten requests finish, one at a time
            queue.release()
            await settle()
        # round robin: a, b, a, b, ...; b's last is admitted with 195 of a's still waiting
        assert order == ["a", "b"] * 5
        assert queue.num_waiting_for("a") == 195 and waiting_metric("b") == 0
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert queue.num_waiting == 0 and waiting_metric("a") == 0

    run(scenario())


def test_a_key_of_weight_2_gets_two_turns_to_another_keys_one():
    async def scenario():
        queue = AdmissionQueue(lambda: 1, max_queued=1000, timeout_s=10)
        order = await served_in_turn(queue, ["a"] * 6 + ["b"] * 6, weights={"a": 2})
        assert order[:9] == ["a", "b", "a", "a", "b", "a", "a", "b", "a"]  # 2 turns to 1
        assert queue.num_waiting == 0

    run(scenario())


def test_without_keys_one_queue_serves_first_come_first_served():
    async def scenario():
        queue = AdmissionQueue(lambda: 1, max_queued=1000, timeout_s=10)
        names = [f"r{i}" for i in range(6)]
        await queue.acquire()
        order = []
        tasks = [asyncio.create_task(queue.acquire()) for _ in names]
        await settle()
        for task, name in zip(tasks, names):
            task.add_done_callback(lambda _, name=name: order.append(name))
        for _ in names:
            queue.release()
            await settle()
        assert order == names and waiting_metric("") == 0

    run(scenario())


def test_a_full_queue_sheds_the_longest_keys_newest_not_a_quieter_keys_request():
    async def scenario():
        queue = AdmissionQueue(lambda: 1, max_queued=4, timeout_s=10)
        await queue.acquire("a")
        a_waiting = [asyncio.create_task(queue.acquire("a")) for _ in range(4)]
        await settle()
        b_waiting = asyncio.create_task(queue.acquire("b"))  # the queue is full of a's
        await settle()
        with pytest.raises(GatewayError) as err:
            await a_waiting[-1]  # a's newest made room
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.retry_after_s
        assert queue.num_waiting_for("a") == 3 and queue.num_waiting_for("b") == 1
        with pytest.raises(GatewayError):  # a, still the longest, is refused itself
            await queue.acquire("a")
        queue.release()
        await settle()
        assert a_waiting[0].done() and not b_waiting.done()  # a's turn, then b's
        queue.release()
        await b_waiting
        for task in a_waiting[1:3]:
            task.cancel()
        await asyncio.gather(*a_waiting, return_exceptions=True)
        assert queue.num_waiting == 0 and queue.num_admitted == 1

    run(scenario())
