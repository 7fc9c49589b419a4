"""Drives one engine from a thread of its own; gRPC handler threads submit, read and abort.

The engine is single-threaded, so only the loop thread touches it. Handlers send commands
(admit a request, abort it, or call any engine method) through a queue and read their
request's outputs from a queue of its own. Every
stream ends with a finished output or an exception, so no handler waits forever: an abort,
an engine failure and shutdown all close the streams they affect.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional, Union

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)

StreamItem = Union[RequestOutput, Exception]
IDLE_POLL_S = 0.05


class WorkerStopped(Exception):
    """The worker is shutting down; the request did not (or will not) complete."""


class EngineFailed(Exception):
    """The engine raised during a step; every request in flight was failed."""


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, queue.SimpleQueue] = {}  # the loop thread's alone
        self._stopping = threading.Event()
        self.num_aborted = 0
        self.num_requests = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)

    def submit(self, request_id: str, admit: Callable[[], Optional[RequestOutput]]) -> queue.SimpleQueue:
        """Admit a request by running `admit` on the loop thread (it adds the request to the
        engine and may return a first output, as `import_kv` does); returns the queue its
        outputs arrive on. Raises what `admit` raised (InvalidRequestError, ...), or WorkerStopped."""
        if self._stopping.is_set():
            raise WorkerStopped("the worker is shutting down")
        accepted: Future = Future()
        stream: queue.SimpleQueue = queue.SimpleQueue()
        self._commands.put(("add", request_id, admit, stream, accepted))
        self._wait(accepted)
        return stream

    def call(self, fn: Callable, *args):
        """Runs `fn(*args)` on the loop thread between steps; returns its result or raises."""
        if self._stopping.is_set():
            raise WorkerStopped("the worker is shutting down")
        done: Future = Future()
        self._commands.put(("call", fn, args, done))
        return self._wait(done)

    def post(self, fn: Callable, *args) -> None:
        """Queues `fn(*args)` for the loop thread without waiting (errors are logged)."""
        self._commands.put(("call", fn, args, None))

    def _wait(self, future: Future):
        """A command's result; WorkerStopped if the loop ended before it ran the command."""
        while True:
            try:
                return future.result(timeout=IDLE_POLL_S * 10)
            except FutureTimeout:
                if not self._thread.is_alive():
                    raise WorkerStopped("the worker shut down") from None

    def abort(self, request_id: str, count: bool = True) -> None:
        """Stop a request and free its blocks. `count=False` for a planned release (a prefill
        worker done with a sequence's KV), which `num_aborted` should not count."""
        self._commands.put(("abort", request_id, count))

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._apply_commands(block=not self.engine.has_unfinished_requests())
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # never leave a stream waiting on a broken engine
                log.exception("engine step failed; failing %d requests", len(self._streams))
                self._fail_all(EngineFailed(f"engine step failed: {exc}"))
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
                    if out.finished:
                        del self._streams[out.request_id]
        self._apply_commands(block=False)
        self._fail_all(WorkerStopped("the worker shut down before the request finished"))

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        if command[0] == "add":
            _, request_id, admit, stream, accepted = command
            if self._stopping.is_set():
                accepted.set_exception(WorkerStopped("the worker is shutting down"))
                return
            try:
                first = admit()
            except Exception as exc:
                accepted.set_exception(exc)
                return
            self.num_requests += 1
            if first is not None:
                stream.put(first)
            if first is None or not first.finished:
                self._streams[request_id] = stream
            accepted.set_result(None)
        elif command[0] == "call":
            _, fn, args, done = command
            try:
                result = fn(*args)
            except Exception as exc:
                if done is None:
                    log.exception("engine call %s failed", getattr(fn, "__name__", fn))
                else:
                    done.set_exception(exc)
            else:
                if done is not None:
                    done.set_result(result)
        else:
            _, request_id, count = command
            stream = self._streams.pop(request_id, None)
            if self.engine.abort(request_id):
                self.num_aborted += count
                if stream is not None:
                    stream.put(WorkerStopped(f"request {request_id!r} was aborted"))

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.put(error)
        self._streams.clear()
