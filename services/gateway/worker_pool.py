"""Runs one generation on the workers and streams its tokens, whatever the topology.

- Colocated: the request's stream on the least-loaded worker, over the one GenerateMany call
  the gateway keeps there (shared_call.py): a step's tokens for all requests in one message.
- Disaggregated (the set has prefill or decode workers): pick a prefill and a decode worker,
  call `Prefill` on the first with the second's KV address (retried as below), send the first
  token on at once, then stream the rest from `Decode`. The prefill worker's
  `num_cached_tokens` is written into every decode chunk: the decode worker cannot know it.

Failures become gateway errors with the status a client should see, never a hang (every
call has a deadline). Where nothing has streamed yet, a failure is retried once on another
worker, decided by its status code and, for a Prefill, by the trailer that names the side
that failed (services/failed_peer.py), never by the error's text:
- colocated: a worker that is down, draining or stopping, or dies (UNAVAILABLE, UNKNOWN,
  INTERNAL, CANCELLED) is marked down and another is tried;
- prefill side (no trailer): UNAVAILABLE marks the prefill worker down; that, a hang past
  the prefill's own shorter deadline (DEADLINE_EXCEEDED), a full prefill worker
  (RESOURCE_EXHAUSTED) or a crash (UNKNOWN, INTERNAL, CANCELLED) is retried on another
  prefill worker;
- decode side (`tandem-failed-peer: decode`): the KV could not reach the decode worker
  (UNAVAILABLE) or it had no room (RESOURCE_EXHAUSTED): retried with another decode worker,
  the prefill worker staying in service (its cache now holds the prompt).
After the last try the client sees RESOURCE_EXHAUSTED (429) if the last failure was one, else
UNAVAILABLE. A worker that dies mid-stream ends the stream with UNAVAILABLE: tokens already
sent are never sent again.

This module and worker_messages.py are the gateway's edge to the Worker API: protobuf stays
inside them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from engine.block_hash import hash_blocks, salt_root
from services import failed_peer, tracing
from services.gateway import metrics
from services.gateway.errors import GatewayError
from services.gateway.protocol import GenerationRequest, TokenChunk
from services.gateway.routing.affinity import AffinityTable
from services.gateway.routing.endpoints import Endpoint, EndpointSet, InFlight
from services.gateway.routing.policies import Policy, Route, RouteRequest
from services.gateway.routing.store_view import StoreView
from services.gateway.worker_messages import (
    prefill_chunk,
    sampling_message,
    store_tokens,
    token_chunk,
)
from tandem.v1 import worker_pb2

PASSED_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
# CANCELLED here is the worker's doing (the gateway's own cancel raises CancelledError): a
# server that stops kills the calls it had not yet handed to a handler.
WORKER_DOWN = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
}
PREFILL_RETRIED = WORKER_DOWN | {
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
ATTEMPTS = 2
WHAT = {"both": "worker", "prefill": "prefill worker", "decode": "decode worker"}


@dataclass
class _Prefilled:
    """A prompt prefilled, its KV sent to `decode`: what the decode stream starts from."""

    response: worker_pb2.PrefillResponse
    decode: Endpoint
    decode_load: InFlight  # the decode worker's load, counted until the stream ends
    request_id: str  # this attempt's (a retry's KV must not meet a dead attempt's)


class WorkerPool:
    def __init__(
        self,
        endpoints: EndpointSet,
        request_timeout_s: float,
        prefill_timeout_s: float,
        policy: Policy,
        affinity: AffinityTable,
        store: StoreView | None = None,
    ):
        self.endpoints = endpoints
        self.request_timeout_s = request_timeout_s
        self.prefill_timeout_s = min(prefill_timeout_s, request_timeout_s)
        self.policy = policy
        self.affinity = affinity
        self.store = store  # what the KV store holds, for the routing cost

    @property
    def disaggregated(self) -> bool:
        return self.endpoints.has_role("prefill") or self.endpoints.has_role("decode")

    def capacity(self) -> int:
        """Requests the serving workers' batches hold now (the admission queue's limit)."""
        role = "decode" if self.disaggregated else "both"
        return sum(e.max_num_seqs for e in self.endpoints.eligible(role))

    def generate(self, request: GenerationRequest, trace_context=None) -> AsyncIterator[TokenChunk]:
        """Streams the request's tokens. Cancelling the consumer cancels the worker calls. The
        worker calls carry `trace_context` on (W3C traceparent)."""
        if self.disaggregated:
            return self._disaggregated(request, trace_context)
        return self._colocated(request, trace_context)

    async def _colocated(self, request: GenerationRequest, ctx) -> AsyncIterator[TokenChunk]:
        message = worker_pb2.GenerateRequest(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling_message(request),
            cache_salt=request.cache_salt,
        )
        num_prompt, tried = len(request.prompt_token_ids), ()
        route_request = await self._route_request(request, "both")
        for attempt in range(ATTEMPTS):
            candidates = [e for e in self.endpoints.eligible("both") if e not in tried]
            route = self._route("both", request, route_request, candidates, attempt, ctx)
            endpoint = route.endpoint
            tried += (endpoint,)
            started = False
            with self.endpoints.in_flight(
                endpoint,
                prefill_tokens=num_prompt - route.num_cached_tokens,
                decode_tokens_after_prefill=num_prompt + request.sampling.max_tokens,
                block_hashes=route_request.block_hashes,
            ) as load:
                responses = endpoint.shared_call.stream(
                    message, self.request_timeout_s, tracing.inject(ctx)
                )
                try:
                    async for response in responses:
                        if not started:
                            started = True
                            load.move_to_decode(num_prompt + request.sampling.max_tokens)
                        yield token_chunk(response)
                    return
                except grpc.aio.AioRpcError as exc:
                    # Refused before it started (draining, down): nothing streamed, so retry.
                    if started or exc.code() not in WORKER_DOWN or attempt + 1 == ATTEMPTS:
                        raise self._worker_error(exc, endpoint) from None
                    self.endpoints.mark_down(endpoint)
                finally:
                    await responses.aclose()

    async def _disaggregated(self, request: GenerationRequest, ctx) -> AsyncIterator[TokenChunk]:
        """Prefill on one worker (retried on another pair of workers while nothing has
        streamed), then stream the decode from the worker its KV went to."""
        sampling = sampling_message(request)
        prefilled = await self._prefill_with_retry(request, sampling, ctx)
        with prefilled.decode_load:
            yield prefill_chunk(prefilled.response)
            if prefilled.response.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED:
                return  # the first token ended it
            async for chunk in self._stream_decode(request, sampling, prefilled, ctx):
                yield chunk

    def _pick(
        self,
        request: GenerationRequest,
        route_request: RouteRequest,
        prefills: list[Endpoint],
        not_decode: tuple[Endpoint, ...],
        attempt: int,
        ctx,
    ) -> tuple[Route, Endpoint]:
        """A prefill worker among `prefills` and a decode worker for its KV, not one of
        `not_decode` where there are others."""
        prefill = self._route("prefill", request, route_request, prefills, attempt, ctx)
        decode = self._route(
            "decode",
            request,
            route_request,
            _untried(self.endpoints.eligible("decode"), not_decode),
            attempt,
            ctx,
        )
        return prefill, decode.endpoint

    async def _prefill_with_retry(
        self, request: GenerationRequest, sampling: worker_pb2.SamplingParams, ctx
    ) -> _Prefilled:
        """The prompt prefilled and its KV on a decode worker, in at most ATTEMPTS tries. A
        retry leaves out the side that failed where the role has other workers."""
        num_prompt = len(request.prompt_token_ids)
        route_request = await self._route_request(request, "prefill")
        failure, failed_prefills, failed_decodes, num_failed = None, (), (), 0
        for attempt in range(ATTEMPTS):
            prefills = _untried(self.endpoints.eligible("prefill"), failed_prefills)
            if not prefills:
                break
            prefill_route, decode = self._pick(
                request, route_request, prefills, failed_decodes, attempt, ctx
            )
            prefill = prefill_route.endpoint
            # a retry's KV must not meet a dead attempt's
            request_id = f"{request.request_id}-{attempt}"
            # Counted from now: its blocks are reserved as soon as the KV starts to arrive.
            decode_load = self.endpoints.in_flight(
                decode, decode_tokens=num_prompt + request.sampling.max_tokens
            )
            try:
                response = await self._prefill(
                    prefill,
                    decode,
                    request,
                    sampling,
                    request_id,
                    ctx,
                    num_prompt - prefill_route.num_cached_tokens,
                    route_request.block_hashes,
                )
            except grpc.aio.AioRpcError as exc:
                decode_load.close()
                if self._failed_side(exc, prefill) == failed_peer.DECODE:
                    failed_decodes += (decode,)
                else:
                    failed_prefills += (prefill,)
                failure, num_failed = exc, num_failed + 1  # nothing has streamed: try again
                continue
            except BaseException:
                decode_load.close()
                raise
            return _Prefilled(response, decode, decode_load, request_id)
        if failure is None:
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker is available"
            )
        code = (
            grpc.StatusCode.RESOURCE_EXHAUSTED
            if failure.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            else grpc.StatusCode.UNAVAILABLE
        )
        raise GatewayError(
            code, f"prefill failed in {num_failed} attempt(s); last error: {failure.details()}"
        )

    def _failed_side(self, exc: grpc.aio.AioRpcError, prefill: Endpoint) -> str:
        """The side of a failed Prefill that failed, "prefill" or "decode" (its trailer says
        which); raises the client's error where another try would not help, and marks the
        prefill worker down when it is the one gone."""
        if exc.code() not in PREFILL_RETRIED:
            raise _gateway_error(exc, "prefill worker") from None
        if failed_peer.of(exc.trailing_metadata()) == failed_peer.DECODE:
            return failed_peer.DECODE
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.endpoints.mark_down(prefill)
        return "prefill"

    async def _prefill(
        self,
        prefill: Endpoint,
        decode: Endpoint,
        request: GenerationRequest,
        sampling: worker_pb2.SamplingParams,
        request_id: str,
        ctx,
        num_uncached: int,
        block_hashes: list[int],
    ) -> worker_pb2.PrefillResponse:
        message = worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling,
            kv_destination=decode.kv_address,
            cache_salt=request.cache_salt,
        )
        with self.endpoints.in_flight(
            prefill, prefill_tokens=num_uncached, block_hashes=block_hashes
        ):
            return await prefill.prefill.Prefill(
                message, timeout=self.prefill_timeout_s, metadata=tracing.inject(ctx)
            )

    async def _stream_decode(
        self,
        request: GenerationRequest,
        sampling: worker_pb2.SamplingParams,
        prefilled: _Prefilled,
        ctx,
    ) -> AsyncIterator[TokenChunk]:
        """The tokens after the first, from the decode worker that holds the prompt's KV. The
        prefill's cached and store tokens go into every chunk: the decode worker cannot know them."""
        first = prefilled.response
        message = worker_pb2.DecodeRequest(
            request_id=prefilled.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling=sampling,
            first_token_id=first.first_token_id,
            cache_salt=request.cache_salt,
        )
        call = prefilled.decode.decode.Decode(
            message, timeout=self.request_timeout_s, metadata=tracing.inject(ctx)
        )
        prefill_store_tokens = store_tokens(first)
        try:
            async for response in call:
                chunk = token_chunk(response)
                chunk.num_prompt_tokens, chunk.num_cached_tokens = (
                    first.num_prompt_tokens,
                    first.num_cached_tokens,
                )
                chunk.store_tokens = prefill_store_tokens
                yield chunk
        except grpc.aio.AioRpcError as exc:
            raise self._worker_error(exc, prefilled.decode) from None
        finally:
            call.cancel()

    async def _route_request(self, request: GenerationRequest, role: str) -> RouteRequest:
        """What the policies see of a generation, made once for all its routing decisions: the
        prompt's block hashes and, with a KV store, what the store holds of it."""
        workers = self.endpoints.eligible(role)
        block_size = workers[0].block_size if workers else 16
        route_request = RouteRequest(
            len(request.prompt_token_ids),
            request.sampling.max_tokens,
            # salted as the workers salt them: a prefix cached under another salt never matches
            hash_blocks(request.prompt_token_ids, block_size, salt_root(request.cache_salt)),
            request.session,
        )
        if self.store is not None and workers:  # a worker loads at most all but the last token
            cacheable = route_request.block_hashes[
                : (route_request.num_prompt_tokens - 1) // block_size
            ]
            route_request.stored_tiers = self.store.stored_tiers(
                workers[0].kv_store_namespace, cacheable
            )
        return route_request

    def _route(
        self,
        role: str,
        request: GenerationRequest,
        route_request: RouteRequest,
        candidates: list[Endpoint],
        attempt: int,
        ctx,
    ) -> Route:
        """The session's worker when it should have the request (routing/affinity.py), else the
        policy's pick; counted in metrics, and a span with the policy and the worker."""
        if not candidates:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"no healthy {WHAT[role]} is available")
        route = None
        if request.session and not attempt:
            endpoint = self.affinity.lookup(role, request.session, candidates)
            if endpoint is not None:
                matched = self.policy.index.match(route_request.block_hashes, [endpoint])[endpoint]
                route = Route(
                    endpoint,
                    "affinity",
                    min(matched * endpoint.block_size, route_request.num_prompt_tokens),
                )
        if route is None:
            route = self.policy.pick(role, route_request, candidates)
            if route is None:
                raise GatewayError(
                    grpc.StatusCode.UNAVAILABLE, f"no healthy {WHAT[role]} is available"
                )
        if attempt:
            route.reason = "retry"
        if request.session:
            self.affinity.remember(role, request.session, route.endpoint)
        metrics.ROUTING.labels(f"{self.policy.name}:{role}", route.reason).inc()
        span, _ = tracing.start_span(
            "route",
            ctx,
            policy=self.policy.name,
            role=role,
            reason=route.reason,
            worker=route.endpoint.address,
            num_cached_tokens=route.num_cached_tokens,
        )
        span.end()
        return route

    def _worker_error(self, exc: grpc.aio.AioRpcError, endpoint: Endpoint) -> GatewayError:
        if exc.code() in WORKER_DOWN:
            self.endpoints.mark_down(endpoint)
        return _gateway_error(exc, f"{endpoint.role} worker")

    async def close(self) -> None:
        await self.endpoints.close()


def _untried(endpoints: list[Endpoint], tried: tuple[Endpoint, ...]) -> list[Endpoint]:
    return [e for e in endpoints if e not in tried] or endpoints


def _gateway_error(exc: grpc.aio.AioRpcError, who: str) -> GatewayError:
    code = exc.code() if exc.code() in PASSED_THROUGH else grpc.StatusCode.UNAVAILABLE
    return GatewayError(code, f"{who}: {exc.details()}")
