"""What every role's servicer shares about a call: the worker's state (its engine loop, the
drain, calls in flight), a request's life in the engine (`Request`), and the status a
failure ends a call with.

A handler awaits its request's outputs (or takes them as they come, GenerateMany); a client
that cancels cancels the handler's task, and leaving `serving` (or closing the Request)
aborts the request in the engine (a no-op once it has finished). While the worker drains,
new requests are refused with UNAVAILABLE before anything starts, so the gateway retries
them elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import grpc

from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.requests import AddRequest, FromStore
from services import tracing
from services.worker import convert, metrics
from services.worker.engine_loop import EngineFailed, EngineLoop, OutputStream, WorkerStopped
from tandem.v1 import worker_pb2


class WorkerState:
    """What every servicer of one worker shares: the engine loop, drain state, calls in flight."""

    def __init__(self, loop: EngineLoop, model_name: str, role: str, max_num_seqs: int):
        self.loop = loop
        self.model_name = model_name
        self.role = role
        self.max_num_seqs = max_num_seqs
        self.draining = False
        self.num_active_calls = 0
        self.kv_address = ""  # decode role: where prefill workers push KV
        # decode role (and any role with a KV store): KV accepted and not yet claimed
        self.kv_inbox = None
        self.kv_store = None  # services.worker.kv_store.StoreConnector, with --kv-store
        self.speculative = "off"  # the drafter, as Health reports it

    async def admit(self, req: Request, request: AddRequest) -> None:
        """Admits `request` as `req`. With a KV store, the stored prefix this worker lacks is
        loaded first and comes with it (`FromStore`): the engine caches it just before queueing."""
        store = self.kv_store
        loaded = (
            await store.load_prefix(req.request_id, request.prompt_token_ids, request.cache_salt)
            if store is not None
            else None
        )
        req.loaded = loaded
        if loaded is not None:
            request = dataclasses.replace(
                request, kv=FromStore(loaded.reservation, loaded.block_hashes)
            )
        await req.admit(request)

    def offer_to_store(self, prompt: list[int], cache_salt: str = "") -> None:
        if self.kv_store is not None:
            self.kv_store.offer(prompt, cache_salt)

    def drain(self) -> None:
        """From now on new calls (and a decode worker's new KV) get UNAVAILABLE, so the gateway
        retries them elsewhere; those in flight finish."""
        self.draining = True
        if self.kv_inbox is not None:
            self.kv_inbox.draining = True

    def num_in_flight(self) -> int:
        """Calls running, plus KV that landed (or is landing) for a Decode call still to come."""
        return self.num_active_calls + (
            self.kv_inbox.num_transfers if self.kv_inbox is not None else 0
        )

    async def check_accepting(self, context: grpc.aio.ServicerContext) -> None:
        refusal = self.refusal()
        if refusal is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, refusal)

    @contextlib.asynccontextmanager
    async def serving(self, context: grpc.aio.ServicerContext, span_name: str):
        """Counts the call for the drain, opens its span under the caller's trace, and maps
        the loop's failures to statuses."""
        self.num_active_calls += 1
        # Not made current: a streaming handler may resume in another context, where a
        # current span could not be detached. Child spans name it as their parent instead.
        span, _ = tracing.start_span(
            span_name, tracing.extract(context.invocation_metadata()), role=self.role
        )
        try:
            yield span
        except (InvalidRequestError, WorkerStopped, EngineFailed) as exc:
            await context.abort(status_of(exc), str(exc))
        finally:
            span.end()
            self.num_active_calls -= 1

    def refusal(self) -> str | None:
        """Why new requests are refused now (UNAVAILABLE); None while they are taken."""
        if self.draining:
            return "this worker is draining (shutting down); try another"
        if self.loop.broken:
            return f"this worker's engine failed ({self.loop.broken}); try another"
        return None


def status_of(exc: Exception) -> grpc.StatusCode:
    """The status a request's failure ends its call with."""
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, WorkerStopped):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL  # EngineFailed, and anything unforeseen


async def sampling_params(context: grpc.aio.ServicerContext, msg: worker_pb2.SamplingParams):
    try:
        return convert.sampling_params(msg)
    except InvalidRequestError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


class Request:
    """One request in the engine, from admission until its last output; leaving it early
    (an error, a cancelled call) aborts the request."""

    def __init__(
        self,
        loop: EngineLoop,
        request_id: str,
        count_abort: bool = True,
        count_prompt: bool = True,
        on_prompt_done: Callable[[], None] = lambda: None,
        sink: Callable | None = None,
    ):
        self.loop = loop
        self.request_id = request_id
        self.count_abort = count_abort  # False for a planned release (prefill role)
        # False where the prompt was computed elsewhere (decode role)
        self.count_prompt = count_prompt
        self.on_prompt_done = on_prompt_done  # at the first output (write-through to the KV store)
        self.sink = sink  # takes the outputs as they come, instead of next() (OutputStream.sink)
        self.loaded = None  # services.worker.kv_store.Loaded: the prefix the KV store pushed
        self._store_tokens: worker_pb2.StoreTokens | None = None
        self.stream: OutputStream | None = None
        self.num_outputs = 0
        self.finished = False

    async def admit(self, request: AddRequest) -> Request:
        try:
            self.stream = await self.loop.submit(request, self.sink)
        except asyncio.CancelledError:  # the caller left while the admission was queued
            # runs after it: nothing is left behind
            self.loop.abort(self.request_id, count=self.count_abort)
            raise
        return self

    async def next(self) -> RequestOutput:
        return self.observe(await self.stream.next())

    def observe(self, out: RequestOutput) -> RequestOutput:
        """Counts an output: the prompt's metrics at the first, the finish at the last."""
        if self.num_outputs == 0 and self.count_prompt:
            metrics.count_prompt(out.num_prompt_tokens, out.num_cached_tokens)
            self.on_prompt_done()
        self.num_outputs += 1
        if out.finished:
            self.finished = True
            metrics.REQUESTS.labels(out.finish_reason or "stop").inc()
        return out

    def store_tokens(self, out: RequestOutput) -> worker_pb2.StoreTokens | None:
        """Of the request's cached tokens, those the store loaded (fixed after the first output)."""
        if self.loaded is not None and self._store_tokens is None:
            self._store_tokens = worker_pb2.StoreTokens(
                **self.loaded.store_tokens(out.num_cached_tokens)
            )
        return self._store_tokens

    async def responses(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        while not self.finished:
            out = await self.next()
            yield convert.generate_response(out, self.store_tokens(out))

    def close(self) -> None:
        if self.stream is not None and not self.finished:
            self.loop.abort(self.request_id, count=self.count_abort)
            if self.count_abort:
                metrics.REQUESTS.labels("cancelled").inc()

    async def __aenter__(self) -> Request:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
