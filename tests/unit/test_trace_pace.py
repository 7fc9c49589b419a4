"""bench/trace_pace.py: at the trace's pace every request goes at its arrival time however
slow the replies; at the clients' pace a busy client pool holds later requests back."""

from __future__ import annotations

import threading
import time

import pytest

from bench import trace_pace

ARRIVALS_S = [0.0, 0.05, 0.10, 0.15, 0.20]
REPLY_S = 0.3


def replay(pace: str) -> list[float]:
    """When each request was sent, from the replay's start."""
    start, lock, sent = time.perf_counter(), threading.Lock(), {}

    def send(i: int) -> int:
        with lock:
            sent[i] = time.perf_counter() - start
        time.sleep(REPLY_S)  # a slow server
        return i

    assert trace_pace.replay(ARRIVALS_S, send, pace, num_clients=1) == list(range(5))
    return [sent[i] for i in range(5)]


def test_the_trace_pace_sends_each_request_at_its_time_without_waiting_for_replies():
    for at_s, sent_s in zip(ARRIVALS_S, replay("trace")):
        assert at_s <= sent_s < at_s + 0.1


def test_the_clients_pace_waits_for_a_free_client():
    sent = replay("clients")
    assert sent[-1] >= 4 * REPLY_S  # one client: each request after the last reply


def test_an_unknown_pace_is_refused():
    with pytest.raises(ValueError):
        trace_pace.replay([0.0], lambda i: i, "fast")
