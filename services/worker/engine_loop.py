"""Drives one engine from a thread of its own; gRPC handler threads submit, read and abort.

The engine is single-threaded, so only the loop thread touches it. Handlers send commands
(add, abort) through a queue and read their request's outputs from a queue of its own. Every
stream ends with a finished output or an exception, so no handler waits forever: an abort,
an engine failure and shutdown all close the streams they affect.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Union

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

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
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=10)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> queue.SimpleQueue:
        """Queue a request; returns the queue its outputs arrive on. Raises the engine's
        InvalidRequestError synchronously, or WorkerStopped."""
        if self._stopping.is_set():
            raise WorkerStopped("the worker is shutting down")
        accepted: Future = Future()
        stream: queue.SimpleQueue = queue.SimpleQueue()
        self._commands.put(("add", request_id, prompt_token_ids, params, stream, accepted))
        accepted.result()
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

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
            _, request_id, prompt, params, stream, accepted = command
            if self._stopping.is_set():
                accepted.set_exception(WorkerStopped("the worker is shutting down"))
                return
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as exc:
                accepted.set_exception(exc)
                return
            self._streams[request_id] = stream
            accepted.set_result(None)
        else:
            _, request_id = command
            stream = self._streams.pop(request_id, None)
            if self.engine.abort(request_id):
                self.num_aborted += 1
                if stream is not None:
                    stream.put(WorkerStopped(f"request {request_id!r} was aborted"))

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.put(error)
        self._streams.clear()
