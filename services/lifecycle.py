"""What every service process does the same way: its entry point, its start-up failure line,
its metrics endpoint, waiting for SIGTERM, and draining.

A service prints `<name> ready on HOST:PORT [key=HOST:PORT ...]` once it serves, or
`<name> failed to start: <cause>` and exits 1 (the launcher and the tests read both lines).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from typing import Awaitable, Callable, NoReturn, TypeVar

from engine.errors import EngineError

log = logging.getLogger(__name__)
DRAIN_POLL_S = 0.05

# Failures a user can fix from the message alone: no traceback for these.
EXPECTED_FAILURES = (EngineError, ValueError, OSError)


Config = TypeVar("Config")


class PortInUse(OSError):
    pass


def run(name: str, from_args: Callable[[], Config], serve: Callable[[Config], Awaitable[None]],
        setup: Callable[[], None] = lambda: None) -> None:
    """A service's `main`: its log format, its config from the flags (a bad flag is its
    failure line), `setup` (tracing), then `serve` on a new event loop."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    try:
        config = from_args()
    except ValueError as exc:
        fail_start(name, exc)
    setup()
    asyncio.run(serve(config))


def fail_start(name: str, exc: BaseException) -> NoReturn:
    if not isinstance(exc, EXPECTED_FAILURES):
        log.exception("%s failed to start", name)
    print(f"{name} failed to start: {exc}", flush=True)
    sys.exit(1)


def bind(server, host: str, port: int) -> int:
    """Binds a grpc.aio server; a taken port becomes a one-line cause."""
    try:
        return server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        raise PortInUse(f"cannot listen on {host}:{port} (is the port already taken?)") from None


def start_metrics(host: str, port: int, registry) -> str:
    """Serves a Prometheus registry at /metrics from a daemon thread; returns its HOST:PORT."""
    from prometheus_client import disable_created_metrics, start_http_server

    disable_created_metrics()

    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise PortInUse(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    return f"{host}:{server.server_port}"


async def wait_for_stop_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def drain(name: str, busy: Callable[[], int], timeout_s: float) -> None:
    """Waits until `busy()` (work in flight) is 0, or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    if busy():
        log.info("%s draining: %d in flight, up to %.0fs", name, busy(), timeout_s)
    while busy() and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if busy():
        log.warning("%s drain deadline passed with %d still in flight; stopping them", name, busy())
