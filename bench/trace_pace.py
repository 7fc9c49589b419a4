"""Sends a trace's requests at their arrival times, in one of two paces.

- `clients` (bench/prompt_cache.py's default, what its earlier figures used): a fixed pool of
  client threads; a request goes at its arrival time or once a client is free, whichever is
  later, so at most `num_clients` are in flight and a slow server slows the trace down.
- `trace`: an open loop, as a real client population sends: every request goes at its arrival
  time on a thread of its own, however many earlier ones are still waiting for their replies.
  A slow server sees the load pile up instead of the trace waiting for it.

Arrival times are the trace's x `time_scale` (1: the trace's own pace).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PACES = ("clients", "trace")


def replay(
    arrivals_s: list[float],
    send: Callable[[int], Any],
    pace: str,
    time_scale: float = 1.0,
    num_clients: int = 128,
) -> list[Any]:
    """`send(i)` for every request i at `arrivals_s[i]` x `time_scale` from now (in order of
    arrival); returns their results, in order. A `send` that raises fails the replay."""
    if pace not in PACES:
        raise ValueError(f"pace must be one of {PACES}, not {pace!r}")
    results: list[Any] = [None] * len(arrivals_s)
    start = time.perf_counter()

    def wait_for(i: int) -> None:
        delay = arrivals_s[i] * time_scale - (time.perf_counter() - start)
        if delay > 0:
            time.sleep(delay)

    if pace == "clients":

        def one(i: int) -> None:
            wait_for(i)
            results[i] = send(i)

        with ThreadPoolExecutor(num_clients) as pool:
            list(pool.map(one, range(len(arrivals_s))))
        return results

    errors: list[BaseException] = []

    def own_thread(i: int) -> None:
        try:
            results[i] = send(i)
        except BaseException as exc:  # reported once every request has ended
            errors.append(exc)

    threads = []
    for i in sorted(range(len(arrivals_s)), key=arrivals_s.__getitem__):
        wait_for(i)
        thread = threading.Thread(target=own_thread, args=(i,), name=f"request-{i}", daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results
