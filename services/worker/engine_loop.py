"""Drives one engine from a thread of its own, for servicers that run on an asyncio event loop.

The engine is single-threaded, so only the loop thread touches it. Others send it typed
commands through a queue: `Admit` an `AddRequest`, `Abort` a request, or `Call` a function
of the engine's public API (its KV connector's, mostly).
A request's outputs go to an `asyncio.Queue` of its own, handed over to the event loop with
one `call_soon_threadsafe` per step, so the event loop never blocks on the engine and the
engine never waits for the event loop. Every stream ends with a finished output or an
exception, so no handler waits forever: an abort, an engine failure and shutdown all close
the streams they affect.

After every step (and when idle) the loop publishes a `WorkerStats` snapshot (the engine's
`stats()` and the loop's own counts), which Health and the metrics read instead of the live
engine, and drains the engine's KV events into `kv_events` (numbered, for the gateways'
prefix indexes).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field

from engine.errors import RanksFailed
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, RequestOutput
from engine.requests import AddRequest
from services import faults
from services.event_log import EventBatch
from services.worker import metrics
from services.worker.kv_events import KVEventLog

log = logging.getLogger(__name__)

StreamItem = RequestOutput | Exception
IDLE_POLL_S = 0.05


class WorkerStopped(Exception):
    """The worker is shutting down; the request did not (or will not) complete."""


class EngineFailed(Exception):
    """The engine raised during a step; every request in flight was failed."""


@dataclass(frozen=True)
class WorkerStats(EngineStats):
    """What the engine looked like after its last step, with the loop's own counts."""

    num_requests: int = 0  # accepted since start
    num_aborted: int = 0  # cancelled by their caller since start


@dataclass
class OutputStream:
    """One request's outputs, read on the event loop that admitted it: from `items`, or handed
    to `sink` as they come (GenerateMany, which sends every request's outputs of a step together)."""

    request_id: str
    event_loop: asyncio.AbstractEventLoop
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    sink: Callable[[StreamItem], None] | None = None

    def put(self, item: StreamItem) -> None:
        if self.sink is None:
            self.items.put_nowait(item)
        else:
            self.sink(item)

    async def next(self) -> RequestOutput:
        """The next output; raises what stopped the request (WorkerStopped, EngineFailed)."""
        item = await self.items.get()
        if isinstance(item, Exception):
            raise item
        return item


@dataclass
class Admit:
    # `engine.add` may return a first output (KV imported from a prefill worker)
    request: AddRequest
    stream: OutputStream
    accepted: Future


@dataclass
class Abort:
    request_id: str
    count: bool  # False for a planned release, which num_aborted should not count


@dataclass
class Call:
    fn: Callable
    args: tuple
    done: Future | None  # None: nobody waits (errors are logged)


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}  # the loop thread's alone
        self._stopping = threading.Event()
        self._num_requests = 0
        self._num_aborted = 0
        self.stats = WorkerStats(**asdict(engine.stats()))
        self.kv_events = KVEventLog()
        # Why the engine can serve no more (a tensor-parallel rank died or hung: its process
        # group is gone); None while it is sound. The worker then refuses work and reports it.
        self.broken: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)

    # From the event loop.

    async def submit(
        self, request: AddRequest, sink: Callable[[StreamItem], None] | None = None
    ) -> OutputStream:
        """Admits a request (`engine.add` on the loop thread); returns its output stream.
        Raises what the engine raised (InvalidRequestError, ...), or WorkerStopped."""
        self._check_running()
        stream = OutputStream(request.request_id, asyncio.get_running_loop(), sink=sink)
        accepted: Future = Future()
        self._commands.put(Admit(request, stream, accepted))
        await self._wait(accepted)
        return stream

    async def acall(self, fn: Callable, *args):
        """Runs `fn(*args)` on the loop thread between steps; returns its result or raises."""
        self._check_running()
        done: Future = Future()
        self._commands.put(Call(fn, args, done))
        return await self._wait(done)

    async def _wait(self, future: Future):
        wrapped = asyncio.wrap_future(future)
        while True:
            done, _ = await asyncio.wait({wrapped}, timeout=IDLE_POLL_S * 10)
            if done:
                return wrapped.result()
            if not self._thread.is_alive():
                raise WorkerStopped("the worker shut down")

    # From any thread.

    def call(self, fn: Callable, *args):
        """Blocking `acall`, for threads that are not the event loop (KV transports)."""
        self._check_running()
        done: Future = Future()
        self._commands.put(Call(fn, args, done))
        while True:
            try:
                return done.result(timeout=IDLE_POLL_S * 10)
            except TimeoutError:
                if not self._thread.is_alive():
                    raise WorkerStopped("the worker shut down") from None

    def post(self, fn: Callable, *args) -> None:
        """Queues `fn(*args)` for the loop thread without waiting (errors are logged)."""
        self._commands.put(Call(fn, args, None))

    def abort(self, request_id: str, count: bool = True) -> None:
        """Stops a request and frees its blocks (a no-op once it has finished)."""
        self._commands.put(Abort(request_id, count))

    def kv_snapshot(self) -> EventBatch:
        """Every cached block hash now, numbered after the events recorded so far (loop thread)."""
        self.kv_events.record(self.engine.kv.drain_events())
        return self.kv_events.snapshot_of(self.engine.kv.cached_block_hashes())

    def _check_running(self) -> None:
        if self._stopping.is_set():
            raise WorkerStopped("the worker is shutting down")
        if self.broken:
            raise EngineFailed(self.broken)

    # The loop thread.

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._apply_commands(block=not self.engine.has_unfinished_requests())
            dead = self.engine.dead_ranks()
            if dead and not self.broken:  # noticed between steps, even when idle
                self._break(f"tensor-parallel rank process {', '.join(dead)} exited")
            if self.engine.has_unfinished_requests() and not self.broken:
                self._step()
            self.kv_events.record(self.engine.kv.drain_events())
            self._publish_stats()
        self._apply_commands(block=False)
        self._fail_all(WorkerStopped("the worker shut down before the request finished"))

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except RanksFailed as exc:
            self._break(str(exc))
            return
        except Exception as exc:  # never leave a stream waiting on a broken engine
            log.exception("engine step failed; failing %d requests", len(self._streams))
            self._fail_all(EngineFailed(f"engine step failed: {exc}"))
            return
        metrics.ENGINE_STEP.observe(time.perf_counter() - started)
        faults.delay("step_delay_s")
        deliveries = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                deliveries.append((stream, out))
                if out.finished:
                    del self._streams[out.request_id]
        self._deliver(deliveries)

    def _break(self, why: str) -> None:
        log.error(
            "%s; failing %d requests, and this worker serves no more", why, len(self._streams)
        )
        self.broken = why
        self._fail_all(EngineFailed(why))
        self.engine.abort_all()

    @staticmethod
    def _deliver(deliveries: list[tuple[OutputStream, StreamItem]]) -> None:
        """Hands items to their event loops: one wake-up per loop, however many streams."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.event_loop, []).append((stream, item))
        for event_loop, items in by_loop.items():
            try:
                event_loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop has closed: nobody is reading
                pass

    def _publish_stats(self) -> None:
        self.stats = WorkerStats(
            **asdict(self.engine.stats()),
            num_requests=self._num_requests,
            num_aborted=self._num_aborted,
        )
        metrics.publish_engine_stats(self.stats)

    def _apply_commands(self, block: bool) -> None:
        try:
            command = (
                self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: Admit | Abort | Call) -> None:
        if isinstance(command, Admit):
            self._admit(command)
        elif isinstance(command, Call):
            try:
                result = command.fn(*command.args)
            except Exception as exc:
                if command.done is None:
                    log.exception(
                        "engine call %s failed", getattr(command.fn, "__name__", command.fn)
                    )
                else:
                    command.done.set_exception(exc)
            else:
                if command.done is not None:
                    command.done.set_result(result)
        else:
            stream = self._streams.pop(command.request_id, None)
            if self.engine.abort(command.request_id):
                self._num_aborted += command.count
                if stream is not None:
                    self._deliver(
                        [(stream, WorkerStopped(f"request {command.request_id!r} was aborted"))]
                    )

    def _admit(self, command: Admit) -> None:
        if self._stopping.is_set():
            command.accepted.set_exception(WorkerStopped("the worker is shutting down"))
            return
        try:
            first = self.engine.add(command.request)
        except Exception as exc:
            command.accepted.set_exception(exc)
            return
        self._num_requests += 1
        if first is not None:
            self._deliver([(command.stream, first)])
        if first is None or not first.finished:
            self._streams[command.request.request_id] = command.stream
        command.accepted.set_result(None)

    def _fail_all(self, error: Exception) -> None:
        deliveries = []
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            deliveries.append((stream, error))
        self._streams.clear()
        self._deliver(deliveries)


def _put_all(items: list[tuple[OutputStream, StreamItem]]) -> None:
    for stream, item in items:
        stream.put(item)
