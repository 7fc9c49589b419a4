"""Runs one request on the workers and streams its tokens, whatever the topology.

- Colocated: one `Generate` stream on the least-loaded worker.
- Disaggregated (the set has prefill or decode workers): pick a decode worker, call
  `Prefill` on a prefill worker with that decode worker's KV address, send the first token
  on at once, then stream the rest from `Decode`. The prefill worker's `num_cached_tokens`
  is written into every decode response: the decode worker cannot know it.

Failures become gateway errors with the status a client should see, never a hang (every
call has a deadline): a prefill worker that is down, dies or times out is retried once on
another prefill worker (nothing has streamed yet), else UNAVAILABLE (a prefill has its
own, shorter deadline, so a hung prefill worker is retried); a worker that dies
mid-stream ends the stream with UNAVAILABLE.
"""

from __future__ import annotations

from typing import Iterator

import grpc

from services.gateway import balancer
from services.gateway.endpoints import Endpoint, EndpointSet
from services.gateway.errors import GatewayError
from tandem.v1 import worker_pb2

PASSED_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
WORKER_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
PREFILL_ATTEMPTS = 2


class WorkerPool:
    def __init__(self, endpoints: EndpointSet, request_timeout_s: float, prefill_timeout_s: float):
        self.endpoints = endpoints
        self.request_timeout_s = request_timeout_s
        self.prefill_timeout_s = min(prefill_timeout_s, request_timeout_s)

    @property
    def disaggregated(self) -> bool:
        return self.endpoints.has_role("prefill") or self.endpoints.has_role("decode")

    def generate(self, request: worker_pb2.GenerateRequest, on_cancel) -> Iterator[worker_pb2.GenerateResponse]:
        """Streams the request's responses. `on_cancel(callback)` registers the caller's
        cancellation hook, so a client that goes away cancels the worker calls too."""
        if self.disaggregated:
            yield from self._disaggregated(request, on_cancel)
        else:
            yield from self._colocated(request, on_cancel)

    def _colocated(self, request, on_cancel):
        endpoint = _require(balancer.pick_colocated(self.endpoints.eligible("both")), "worker")
        num_prompt = len(request.prompt_token_ids)
        with self.endpoints.in_flight(endpoint, prefill_tokens=num_prompt) as load:
            call = endpoint.worker.Generate(request, timeout=self.request_timeout_s)
            on_cancel(call.cancel)
            for i, response in enumerate(self._stream(call, endpoint)):
                if i == 0:
                    load.move_to_decode(num_prompt + request.sampling.max_tokens)
                yield response

    def _disaggregated(self, request, on_cancel):
        num_prompt = len(request.prompt_token_ids)
        first, failure, tried, decode_load = None, None, (), None
        try:
            for attempt in range(PREFILL_ATTEMPTS):
                prefill = balancer.pick_prefill(self.endpoints.eligible("prefill"), exclude=tried)
                if prefill is None:
                    break
                tried += (prefill,)
                # Picked again on a retry: a decode worker that died meanwhile has left the eligible set.
                decode = _require(balancer.pick_decode(self.endpoints.eligible("decode"), num_prompt), "decode worker")
                if decode_load is not None:
                    decode_load.close()
                # Counted from now: its blocks are reserved as soon as the KV starts to arrive.
                decode_load = self.endpoints.in_flight(decode, decode_tokens=num_prompt + request.sampling.max_tokens)
                request_id = f"{request.request_id}-{attempt}"  # a retry's KV must not meet a dead attempt's
                try:
                    first = self._prefill(prefill, decode, request, request_id, on_cancel)
                    break
                except grpc.FutureCancelledError:
                    return
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.CANCELLED:
                        return
                    if exc.code() not in WORKER_DOWN and exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise _gateway_error(exc, "prefill worker") from None
                    failure = exc  # down, died or timed out: nothing has streamed, so try another
            if first is None:
                if failure is None:
                    raise GatewayError(grpc.StatusCode.UNAVAILABLE, "no healthy prefill worker is available")
                raise GatewayError(grpc.StatusCode.UNAVAILABLE,
                                   f"prefill failed on {len(tried)} worker(s); last error: {failure.details()}")
            yield worker_pb2.GenerateResponse(
                token_ids=[first.first_token_id], logprobs=first.logprobs, finish_reason=first.finish_reason,
                num_prompt_tokens=first.num_prompt_tokens, num_cached_tokens=first.num_cached_tokens,
                stop_string=first.stop_string,
            )
            if first.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED:
                return
            decode_request = worker_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=request.prompt_token_ids, sampling=request.sampling,
                first_token_id=first.first_token_id,
            )
            call = decode.decode.Decode(decode_request, timeout=self.request_timeout_s)
            on_cancel(call.cancel)
            for response in self._stream(call, decode):
                response.num_prompt_tokens = first.num_prompt_tokens
                response.num_cached_tokens = first.num_cached_tokens
                yield response
        finally:
            if decode_load is not None:
                decode_load.close()

    def _prefill(self, prefill: Endpoint, decode: Endpoint, request, request_id: str, on_cancel):
        prefill_request = worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=request.prompt_token_ids, sampling=request.sampling,
            kv_destination=decode.kv_address,
        )
        with self.endpoints.in_flight(prefill, prefill_tokens=len(request.prompt_token_ids)):
            future = prefill.prefill.Prefill.future(prefill_request, timeout=self.prefill_timeout_s)
            on_cancel(future.cancel)
            return future.result()

    def _stream(self, call, endpoint: Endpoint):
        try:
            yield from call
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return
            if exc.code() in WORKER_DOWN:
                self.endpoints.mark_down(endpoint)
            raise _gateway_error(exc, f"{endpoint.role} worker") from None

    def close(self) -> None:
        self.endpoints.close()


def _require(endpoint, what: str) -> Endpoint:
    if endpoint is None:
        raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"no healthy {what} is available")
    return endpoint


def _gateway_error(exc: grpc.RpcError, who: str) -> GatewayError:
    code = exc.code() if exc.code() in PASSED_THROUGH else grpc.StatusCode.UNAVAILABLE
    return GatewayError(code, f"{who}: {exc.details()}")
