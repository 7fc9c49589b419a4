"""What every service process does the same way: its entry point, its start-up failure line,
its gRPC server with grpc.health.v1, its ready line, its metrics endpoint, waiting for SIGTERM,
and draining.

A service prints `<name> ready on HOST:PORT [key=HOST:PORT ...]` once it serves, or
`<name> failed to start: <cause>` and exits 1 (the launcher and the tests read both lines).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.errors import EngineError

log = logging.getLogger(__name__)
DRAIN_POLL_S = 0.05

# Failures a user can fix from the message alone: no traceback for these.
EXPECTED_FAILURES = (EngineError, ValueError, OSError)


Config = TypeVar("Config")


class PortInUse(OSError):
    pass


def run(
    name: str,
    from_args: Callable[[], Config],
    serve: Callable[[Config], Awaitable[None]],
    setup: Callable[[], None] = lambda: None,
) -> None:
    """A service's `main`: its log format, its config from the flags (a bad flag is its
    failure line), `setup` (tracing), then `serve` on a new event loop."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
    )
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


def stop_signal() -> asyncio.Event:
    """Set on SIGTERM or SIGINT. Made before the ready line: a launcher may signal as soon
    as it reads that line, and an unhandled SIGTERM would kill the process undrained."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def drain(name: str, busy: Callable[[], int], timeout_s: float) -> None:
    """Waits until `busy()` (work in flight) is 0, or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    if busy():
        log.info("%s draining: %d in flight, up to %.0fs", name, busy(), timeout_s)
    while busy() and time.monotonic() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    if busy():
        log.warning("%s drain deadline passed with %d still in flight; stopping them", name, busy())


class GrpcService:
    """A service's grpc.aio server, serving grpc.health.v1 beside its own servicers (add them
    to `server`). The life of every service:

        service = GrpcService(name, host, port)   # add servicers, then bind() (failures: fail_start)
        await service.start(metrics=...)          # serving; health SERVING; the ready line
        await service.stopped(draining, busy, s)  # SIGTERM: refuse new work, NOT_SERVING, drain
        await service.stop(grace)
    """

    def __init__(self, name: str, host: str, port: int):
        self.name, self.host, self.port = name, host, port
        self.server = grpc.aio.server()
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)

    def bind(self) -> int:
        self.port = bind(self.server, self.host, self.port)
        return self.port

    async def start(self, **addresses: str | None) -> None:
        """Serves, then prints the ready line with each given `key=address` (None: left out)."""
        # Start-up objects (weights' wrappers, modules, protobuf descriptors) never die: keep the
        # collector from walking them again on every full collection, a pause felt as a late token.
        gc.collect()
        gc.freeze()
        self._stop = stop_signal()
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        extra = "".join(f" {key}={address}" for key, address in addresses.items() if address)
        print(f"{self.name} ready on {self.host}:{self.port}{extra}", flush=True)

    async def stopped(
        self,
        draining: Callable[[], None] = lambda: None,
        busy: Callable[[], int] | None = None,
        drain_timeout_s: float = 0.0,
    ) -> None:
        """Returns once SIGTERM (or SIGINT) has come and the work in flight (`busy()`) has
        drained: `draining()` refuses new work, then health turns NOT_SERVING so the balancers
        route around this process."""
        await self._stop.wait()
        draining()
        await self.health.enter_graceful_shutdown()
        if busy is not None:
            await drain(self.name, busy, drain_timeout_s)

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace=grace)
