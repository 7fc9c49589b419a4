"""One GenerateMany call a colocated worker, shared by every request the gateway sends there.

The worker writes each engine step's outputs for all of them in one message, so at 64 requests
in flight the gateway reads one message a step, not 64 (services/worker/generate_many.py).
`stream` looks to its caller like a Generate call: the responses of one request, ending with
the one that has a finish_reason, or an AioRpcError with the status Generate would have
ended with. The call is opened on first use and again after it breaks; a broken call fails
every request on it with UNAVAILABLE. A request's deadline is kept here: past it, the request
is cancelled on the worker and its caller gets DEADLINE_EXCEEDED, so a hung worker costs at
most the deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from tandem.v1 import worker_pb2, worker_pb2_grpc

STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Call:
    """One open GenerateMany call and the requests on it."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub):
        self.call = stub.GenerateMany()
        self.queues: dict[str, asyncio.Queue] = {}
        self.broken: grpc.aio.AioRpcError | None = None
        self._writes = asyncio.Lock()  # one write at a time on a call
        self._cancels: set[asyncio.Task] = set()
        self.reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for batch in self.call:
                for item in batch.items:
                    queue = self.queues.get(item.request_id)
                    if queue is not None:
                        queue.put_nowait(item)
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker ended the call")
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the gateway closed the call")
        self.broken = error
        for queue in self.queues.values():
            queue.put_nowait(error)

    async def write(self, message: worker_pb2.GenerateManyRequest) -> None:
        async with self._writes:
            await self.call.write(message)

    def cancel(self, request_id: str) -> None:
        """Aborts a request on the worker, without waiting for the write."""
        if self.broken is None:
            task = asyncio.create_task(
                self.write(worker_pb2.GenerateManyRequest(cancel=request_id))
            )
            self._cancels.add(task)
            task.add_done_callback(self._cancel_written)

    def _cancel_written(self, task: asyncio.Task) -> None:
        self._cancels.discard(task)
        if not task.cancelled():
            task.exception()  # a broken call: the reader fails its requests

    def close(self) -> None:
        self.call.cancel()
        self.reader.cancel()


class SharedCall:
    def __init__(self, stub: worker_pb2_grpc.WorkerStub):
        self.stub = stub
        self._call: _Call | None = None
        self.retired = False  # the worker left the set: close once its last request ends

    def _open(self) -> _Call:
        if self._call is None or self._call.broken is not None:
            self._call = _Call(self.stub)
        return self._call

    async def stream(
        self,
        message: worker_pb2.GenerateRequest,
        timeout: float,
        trace_context: list[tuple[str, str]],
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        """The request's responses; raises AioRpcError as a Generate call would. Leaving early
        (the consumer cancelled) cancels the request on the worker."""
        call = self._open()
        request_id = message.request_id
        if request_id in call.queues:
            raise rpc_error(
                grpc.StatusCode.INVALID_ARGUMENT, f"request_id {request_id!r} is already running"
            )
        queue: asyncio.Queue = asyncio.Queue()
        call.queues[request_id] = queue
        deadline = asyncio.get_running_loop().time() + timeout
        finished = False
        try:
            async with asyncio.timeout_at(deadline):
                await call.write(
                    worker_pb2.GenerateManyRequest(add=message, trace_context=dict(trace_context))
                )
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        item = await queue.get()
                except TimeoutError:
                    raise rpc_error(
                        grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
                    ) from None
                if isinstance(item, grpc.aio.AioRpcError):
                    finished = True  # the call broke: nothing to cancel
                    raise item
                if item.error_code:
                    finished = True
                    raise rpc_error(STATUS_CODES[item.error_code], item.error_message)
                finished = item.response.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED
                yield item.response
                if finished:
                    return
        except TimeoutError:  # the add's write timed out: the worker reads nothing
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            call.queues.pop(request_id, None)
            if not finished:
                call.cancel(request_id)
            if self.retired and not call.queues:
                self.close()

    def retire(self) -> None:
        """The worker left the set: the call closes now, or when its last request ends."""
        self.retired = True
        if self._call is None or not self._call.queues:
            self.close()

    def close(self) -> None:
        if self._call is not None:
            self._call.close()
            self._call = None
