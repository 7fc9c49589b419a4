"""GenerateMany: a gateway's requests over one call, each engine step's outputs in one message.

A request on the call is what it is in Generate (the KV store's prefix, the engine, metrics, a
span under the caller's trace, the drain's count of calls in flight), except that its outputs
are not awaited one by one: the engine loop hands a step's outputs to the event loop in one
callback, each goes into `pending`, and the call writes all of them as one GenerateBatch. While
a write waits, later steps' outputs join the next batch. At 64 requests in flight this is one
message a step instead of 64, which is most of the worker's and gateway's gRPC cost.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from engine.outputs import RequestOutput
from engine.requests import AddRequest
from services import tracing
from services.worker import convert
from services.worker.calls import Request, WorkerState, status_of
from tandem.v1 import worker_pb2


class _Member:
    """One request on the call, from its `add` to its last item."""

    def __init__(self, call: ManyCall, add: worker_pb2.GenerateRequest, trace_context):
        self.call = call
        self.request_id = add.request_id
        self.message = add
        self.prompt = prompt = list(add.prompt_token_ids)
        salt = add.cache_salt
        self.span, _ = tracing.start_span(
            "generate",
            tracing.extract(trace_context.items()),
            role=call.state.role,
        )
        self.span.set_attribute("tandem.num_prompt_tokens", len(prompt))
        self.request = Request(
            call.state.loop,
            self.request_id,
            on_prompt_done=lambda: call.state.offer_to_store(prompt, salt),
            sink=self.take,
        )
        self.admission: asyncio.Task | None = None
        self.ended = False

    async def start(self) -> None:
        message = self.message
        try:
            params = convert.sampling_params(message.sampling)
            await self.call.state.admit(
                self.request,
                AddRequest(self.request_id, self.prompt, params, cache_salt=message.cache_salt),
            )
        except Exception as exc:  # InvalidRequestError, WorkerStopped, EngineFailed
            self.fail(exc)

    def take(self, item: RequestOutput | Exception) -> None:
        """An output or failure from the engine loop (on the event loop)."""
        if self.ended:
            return
        if isinstance(item, Exception):
            self.fail(item)
            return
        out = self.request.observe(item)
        response = convert.generate_response(out, self.request.store_tokens(out))
        self.call.send(worker_pb2.GenerateItem(request_id=self.request_id, response=response))
        if out.finished:
            self.end()

    def fail(self, exc: Exception) -> None:
        if self.ended:
            return
        self.call.send(
            worker_pb2.GenerateItem(
                request_id=self.request_id,
                error_code=status_of(exc).value[0],
                error_message=str(exc),
            )
        )
        self.end()

    def cancel(self) -> None:
        """The caller gave the request up: abort it; nothing more is sent for it."""
        if self.admission is not None and not self.admission.done():
            self.admission.cancel()  # Request.admit aborts what it had started
        self.request.close()
        self.end()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.span.end()
            self.call.state.num_active_calls -= 1
            self.call.members.pop(self.request_id, None)


class ManyCall:
    """One GenerateMany call on a colocated worker."""

    def __init__(self, state: WorkerState):
        self.state = state
        self.members: dict[str, _Member] = {}
        self.pending: list[worker_pb2.GenerateItem] = []
        self.ready = asyncio.Event()
        self.caller_done = False

    def send(self, item: worker_pb2.GenerateItem) -> None:
        self.pending.append(item)
        self.ready.set()

    def _add(self, message: worker_pb2.GenerateManyRequest) -> None:
        add = message.add
        if not add.request_id or add.request_id in self.members:
            what = "is missing" if not add.request_id else "is already on this call"
            self.send(
                worker_pb2.GenerateItem(
                    request_id=add.request_id,
                    error_code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                    error_message=f"request_id {add.request_id!r} {what}",
                )
            )
            return
        refusal = self.state.refusal()
        if refusal is not None:
            self.send(
                worker_pb2.GenerateItem(
                    request_id=add.request_id,
                    error_code=grpc.StatusCode.UNAVAILABLE.value[0],
                    error_message=refusal,
                )
            )
            return
        member = _Member(self, add, message.trace_context)
        self.members[member.request_id] = member
        self.state.num_active_calls += 1
        member.admission = asyncio.create_task(member.start())

    async def _read(self, requests: AsyncIterator[worker_pb2.GenerateManyRequest]) -> None:
        try:
            async for message in requests:
                if message.HasField("add"):
                    self._add(message)
                elif message.HasField("cancel"):
                    member = self.members.get(message.cancel)
                    if member is not None:
                        member.cancel()
        finally:
            self.caller_done = True
            self.ready.set()

    async def run(
        self, requests: AsyncIterator[worker_pb2.GenerateManyRequest]
    ) -> AsyncIterator[worker_pb2.GenerateBatch]:
        """The call's batches, until the caller has closed its side and every request ended;
        leaving early (the caller cancelled the call) aborts every request still on it."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self.ready.wait()
                self.ready.clear()
                if self.pending:
                    items, self.pending = self.pending, []
                    yield worker_pb2.GenerateBatch(items=items)
                # Items sent while that write waited (the last requests' final outputs) go out
                # before the call ends.
                if self.caller_done and not self.members and not self.pending:
                    return
        finally:
            reader.cancel()
            for member in list(self.members.values()):
                member.cancel()
