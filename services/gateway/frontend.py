"""A public request from admission to its last event, shared by the gRPC and HTTP edges.

Each generation (one prompt, one choice) takes an admission slot, then streams from the
workers; a request with several (n > 1, or several prompts) runs them concurrently and
merges their events in arrival order, each tagged with its choice index. One trace per
request: a span for the request (under the caller's `traceparent`), and within it one per
generation with its admission and routing; the worker calls carry the context on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry import context as otel_context
from opentelemetry.trace import StatusCode

from services import tracing
from services.gateway import metrics
from services.gateway.admission import AdmissionQueue
from services.gateway.api_keys import ApiKeys, Caller
from services.gateway.errors import GatewayError
from services.gateway.output.generation import generation_events
from services.gateway.prepare.requests import Prepared, ServedModel, key_salted
from services.gateway.pricing import Prices
from services.gateway.protocol import Event, Finish, GenerationRequest, Usages
from services.gateway.worker_pool import WorkerPool


class Frontend:
    def __init__(
        self,
        model: ServedModel,
        pool: WorkerPool,
        admission: AdmissionQueue,
        prices: Prices | None = None,
        keys: ApiKeys | None = None,
    ):
        self.model = model
        self.pool = pool
        self.admission = admission
        self.prices = prices  # usage carries cost when set
        self.keys = keys  # None: every caller is served
        self.draining = False
        self.num_in_flight = 0  # public requests being served (what a drain waits for)

    def drain(self) -> None:
        """From now on new requests get UNAVAILABLE; those in flight finish."""
        self.draining = True

    def authenticate(self, authorization: str | None) -> Caller | None:
        """The caller an `Authorization` value names (None without keys); raises UNAUTHENTICATED."""
        return self.keys.authenticate(authorization) if self.keys is not None else None

    async def events(
        self,
        prepared: Prepared,
        span_name: str,
        parent: otel_context.Context | None = None,
        caller: Caller | None = None,
    ) -> AsyncIterator[Event]:
        """The request's events; raises GatewayError (its status) if it fails. A caller's limits
        are checked first, and its usage counted as the choices finish."""
        if self.draining:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down; retry")
        if caller is None:
            async for event in self._events(prepared, span_name, parent):
                yield event
            return
        caller.admit(sum(len(g.prompt_token_ids) for g in prepared.generations[:: prepared.n]))
        prepared = key_salted(prepared, caller.cache_salt)  # no prefix shared across keys
        usages = Usages(prepared.n)
        try:
            async for event in self._events(
                prepared, span_name, parent, (caller.name, caller.entry.weight)
            ):
                if isinstance(event, Finish):
                    usages.add(event)
                    caller.generated(event.usage.completion_tokens)
                yield event
        finally:
            caller.finished()
            caller.bill(usages.total(), self.prices)

    async def _events(
        self,
        prepared: Prepared,
        span_name: str,
        parent: otel_context.Context | None,
        queue_key: tuple[str, int] = ("", 1),
    ) -> AsyncIterator[Event]:
        """`queue_key`: the admission queue its generations wait in, and that queue's weight."""
        arrived = time.monotonic()
        self.num_in_flight += 1
        span, ctx = tracing.start_span(
            span_name, parent, request_id=prepared.request_id, num_choices=len(prepared.generations)
        )
        try:
            if len(prepared.generations) == 1:
                async for event in self._generation(
                    prepared.generations[0], 0, prepared, arrived, ctx, queue_key
                ):
                    yield event
            else:
                async for event in self._merged(prepared, arrived, ctx, queue_key):
                    yield event
            metrics.REQUESTS.labels(span_name, "ok").inc()
        except GatewayError as exc:
            metrics.REQUEST_ERRORS.labels(exc.code.name.lower()).inc()
            metrics.REQUESTS.labels(span_name, exc.code.name.lower()).inc()
            span.set_status(StatusCode.ERROR, exc.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            metrics.REQUEST_ERRORS.labels("cancelled").inc()
            metrics.REQUESTS.labels(span_name, "cancelled").inc()
            span.set_status(StatusCode.ERROR, "cancelled by the client")
            raise
        finally:
            self.num_in_flight -= 1
            span.end()

    async def _generation(
        self,
        request: GenerationRequest,
        index: int,
        prepared: Prepared,
        arrived: float,
        parent: otel_context.Context,
        queue_key: tuple[str, int],
    ) -> AsyncIterator[Event]:
        span, ctx = tracing.start_span(
            "generation", parent, choice=index, num_prompt_tokens=len(request.prompt_token_ids)
        )
        try:
            queued, _ = tracing.start_span("admission", ctx)
            try:
                queued.set_attribute("tandem.queued_s", await self.admission.acquire(*queue_key))
            finally:
                queued.end()
            metrics.NUM_RUNNING.inc()
            try:
                reasoning_format = self.model.reasoning_format if prepared.chat else None
                # routed and run on the workers (worker_pool.py)
                chunks = self.pool.generate(request, ctx)
                async for event in generation_events(
                    chunks,
                    self.model.tokenizer,
                    request,
                    index,
                    prepared.tool_format,
                    arrived,
                    reasoning_format,
                ):
                    yield event
            finally:
                metrics.NUM_RUNNING.dec()
                self.admission.release()
        finally:
            span.end()

    async def _merged(
        self,
        prepared: Prepared,
        arrived: float,
        ctx: otel_context.Context,
        queue_key: tuple[str, int],
    ) -> AsyncIterator[Event]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def run(index: int, request: GenerationRequest) -> None:
            try:
                async for event in self._generation(
                    request, index, prepared, arrived, ctx, queue_key
                ):
                    queue.put_nowait(event)
                queue.put_nowait(done)
            except BaseException as exc:
                queue.put_nowait(exc)
                raise

        tasks = [asyncio.create_task(run(i, g)) for i, g in enumerate(prepared.generations)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
