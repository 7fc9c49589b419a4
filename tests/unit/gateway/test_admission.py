"""The admission queue on its own: slots, first come first served, bounds, deadlines, leaving."""

from __future__ import annotations

import asyncio

import grpc
import pytest

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
