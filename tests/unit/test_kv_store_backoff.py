"""Proportional back-off of one path to the KV store (services/worker/store_backoff.py): the
skip starts at a fraction of a second, doubles with each failure in a row, stops at 10 s,
starts over after a success, and calls already in flight when a failure is counted add
nothing to it."""

from __future__ import annotations

import pytest

from services.worker import store_backoff
from services.worker.store_backoff import Backoff

DEADLINE_S = 2.0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def timed_out_call(backoff: Backoff, clock: Clock) -> float:
    """One call that runs into its deadline once the path is open again; the skip it caused."""
    clock.now = max(clock.now, backoff.skip_until)
    assert backoff.available()
    started_at = clock.now
    clock.now += DEADLINE_S
    backoff.failed(started_at, TimeoutError("deadline"))
    assert not backoff.available()
    return backoff.skip_until - clock.now


def test_the_skip_doubles_with_failures_in_a_row_up_to_its_cap():
    clock = Clock()
    backoff = Backoff("load", "loading a prefix", clock)
    skips = [timed_out_call(backoff, clock) for _ in range(9)]
    assert skips == pytest.approx([0.25, 0.5, 1, 2, 4, 8, 10, 10, 10])
    assert store_backoff.FIRST_SKIP_S < 1 and store_backoff.MAX_SKIP_S == 10


def test_a_dead_store_costs_at_most_one_deadline_per_back_off_period_once_grown():
    clock = Clock()
    backoff = Backoff("store", "storing blocks", clock)
    while timed_out_call(backoff, clock) < store_backoff.MAX_SKIP_S:
        pass
    started = clock.now
    for _ in range(10):
        timed_out_call(backoff, clock)
    # each call: the skip it waited out, then its deadline
    assert clock.now - started == pytest.approx(10 * (store_backoff.MAX_SKIP_S + DEADLINE_S))


def test_a_success_starts_the_skip_over():
    clock = Clock()
    backoff = Backoff("load", "loading a prefix", clock)
    for _ in range(5):
        timed_out_call(backoff, clock)
    clock.now = backoff.skip_until
    backoff.succeeded()
    assert backoff.available()
    assert timed_out_call(backoff, clock) == pytest.approx(store_backoff.FIRST_SKIP_S)


def test_calls_in_flight_when_a_failure_is_counted_are_one_incident():
    clock = Clock()
    backoff = Backoff("load", "loading a prefix", clock)
    started = [clock.now + 0.01 * i for i in range(10)]  # ten loads go out, the store pauses
    clock.now += DEADLINE_S
    for started_at in started:
        backoff.failed(started_at, TimeoutError("deadline"))
        clock.now += 0.01
    assert backoff.num_failures == 1
    assert backoff.skip_until == pytest.approx(100.0 + DEADLINE_S + store_backoff.FIRST_SKIP_S)
