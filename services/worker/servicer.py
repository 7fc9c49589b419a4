"""The Worker gRPC service over an EngineLoop (grpc.aio): Generate (colocated role) and Health
(all roles), and the call handling every role's servicer shares.

A handler awaits its request's outputs; a client that cancels cancels the handler's task,
and leaving `serving` aborts the request in the engine (a no-op once it has finished).
While the worker drains, new requests are refused with UNAVAILABLE before anything starts,
so the gateway retries them elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from engine.requests import AddRequest, FromStore
from services import tracing
from services.event_log import EventBatch, Unsubscribed, batches_after
from services.worker import convert, metrics
from services.worker.engine_loop import EngineFailed, EngineLoop, OutputStream, WorkerStopped
from tandem.v1 import worker_pb2, worker_pb2_grpc


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
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "this worker is draining (shutting down); try another"
            )
        if self.loop.broken:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"this worker's engine failed ({self.loop.broken}); try another",
            )

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
        except InvalidRequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except WorkerStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except EngineFailed as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        finally:
            span.end()
            self.num_active_calls -= 1


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
    ):
        self.loop = loop
        self.request_id = request_id
        self.count_abort = count_abort  # False for a planned release (prefill role)
        # False where the prompt was computed elsewhere (decode role)
        self.count_prompt = count_prompt
        self.on_prompt_done = on_prompt_done  # at the first output (write-through to the KV store)
        self.loaded = None  # services.worker.kv_store.Loaded: the prefix the KV store pushed
        self._store_tokens: worker_pb2.StoreTokens | None = None
        self.stream: OutputStream | None = None
        self.num_outputs = 0
        self.finished = False

    async def admit(self, request: AddRequest) -> Request:
        try:
            self.stream = await self.loop.submit(request)
        except asyncio.CancelledError:  # the caller left while the admission was queued
            # runs after it: nothing is left behind
            self.loop.abort(self.request_id, count=self.count_abort)
            raise
        return self

    async def next(self) -> RequestOutput:
        out = await self.stream.next()
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


def event_batch(incarnation: str, batch: EventBatch) -> worker_pb2.KVEventBatch:
    return worker_pb2.KVEventBatch(
        incarnation=incarnation,
        first_seq=batch.first_seq,
        snapshot=batch.snapshot,
        events=[
            worker_pb2.KVEvent(evicted=e.kind == "evicted", block_hashes=e.block_hashes)
            for e in batch.events
        ],
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, state: WorkerState):
        self.state = state

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        if self.state.role != "both":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this is a {self.state.role} worker; Generate runs on colocated workers",
            )
        await self.state.check_accepting(context)
        params = await sampling_params(context, request.sampling)
        request_id = request.request_id or uuid.uuid4().hex
        prompt, cache_salt = list(request.prompt_token_ids), request.cache_salt
        async with (
            self.state.serving(context, "generate") as span,
            Request(
                self.state.loop,
                request_id,
                on_prompt_done=lambda: self.state.offer_to_store(prompt, cache_salt),
            ) as req,
        ):
            span.set_attribute("tandem.num_prompt_tokens", len(prompt))
            await self.state.admit(
                req, AddRequest(request_id, prompt, params, cache_salt=cache_salt)
            )
            async for response in req.responses():
                yield response

    async def KVEvents(
        self, request: worker_pb2.KVEventsRequest, context: grpc.aio.ServicerContext
    ):
        loop = self.state.loop
        queue = loop.kv_events.subscribe()  # before the snapshot: no batch after it is missed
        try:
            snapshot = await loop.acall(loop.kv_snapshot)
            yield event_batch(loop.kv_events.incarnation, snapshot)
            async for batch in batches_after(queue, snapshot):
                yield event_batch(loop.kv_events.incarnation, batch)
        except Unsubscribed:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "KV events subscriber fell behind; resubscribe"
            )
        finally:
            loop.kv_events.unsubscribe(queue)

    async def Health(self, request: worker_pb2.HealthRequest, context: grpc.aio.ServicerContext):
        stats = self.state.loop.stats
        return worker_pb2.HealthResponse(
            model=self.state.model_name,
            role=self.state.role,
            num_blocks=stats.num_blocks,
            num_free_blocks=stats.num_free_blocks,
            block_size=self.state.loop.engine.kv.layout.block_size,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            max_model_len=stats.max_model_len,
            num_aborted=stats.num_aborted,
            kv_address=self.state.kv_address,
            num_requests=stats.num_requests,
            # A broken engine reports itself as leaving, so the gateway routes around it.
            draining=self.state.draining or bool(self.state.loop.broken),
            max_num_seqs=self.state.max_num_seqs,
            kv_store_namespace=self.state.kv_store.namespace
            if self.state.kv_store is not None
            else "",
            speculative=self.state.speculative,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_draft_tokens=stats.num_accepted_draft_tokens,
            draft_acceptance_rate=(
                stats.num_accepted_draft_tokens / stats.num_draft_tokens
                if stats.num_draft_tokens
                else 0.0
            ),
        )
