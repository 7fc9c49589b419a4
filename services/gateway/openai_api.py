"""OpenAI-compatible HTTP on uvicorn + Starlette: /v1/chat/completions, /v1/completions,
/v1/models, plus /health and Prometheus /metrics.

One OpenAI path serves both the unary and the streaming call (the body's `stream` field
picks), which a gRPC-JSON transcoder cannot express; so this adapter parses the JSON into
pydantic models (openai_models.py), runs them through the same frontend as gRPC, and writes
JSON or server-sent events (`data: {...}` ... `data: [DONE]`) straight from the gateway's
events, with no protobuf on the way. Errors use OpenAI's error body with the HTTP status of
the gRPC code, and a refusal under load carries `Retry-After`. A stream's headers are sent
with its first event, so a request refused while queued gets a plain 429; an error after
that is sent as an error event, never as a silently truncated stream. A client that
disconnects cancels its generation, streamed or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import AsyncIterator, Optional

import grpc
import prometheus_client
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services import tracing
from services.gateway import metrics, requests
from services.gateway.errors import GatewayError, invalid
from services.gateway.frontend import Frontend
from services.gateway.openai_models import ChatCompletionBody, CompletionBody
from services.gateway.pricing import Prices
from services.gateway.protocol import Delta, Event, Finish, TokenLogprob, Usage, Usages

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
DRAIN_LIMIT_BYTES = 64 << 20  # an oversized body up to this is read and dropped, so the client sees the 413
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def error_response(exc: GatewayError, status: int = 0) -> JSONResponse:
    code_status, body = error_body(exc)
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else {}
    if exc.code == grpc.StatusCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=status or code_status, headers=headers or None)


def error_body(exc: GatewayError) -> tuple[int, dict]:
    status, kind = HTTP_STATUS.get(exc.code, (500, "internal_error"))
    code = "invalid_api_key" if exc.code == grpc.StatusCode.UNAUTHENTICATED else exc.code.name.lower()
    return status, {"error": {"message": exc.message, "type": kind, "param": None, "code": code}}


def usage_json(usage: Usage, prices: Optional[Prices]) -> dict:
    body = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens,
                                                               "cached_tokens_by_tier": usage.cached_tokens_by_tier()},
            "completion_tokens_details": {"accepted_prediction_tokens": usage.accepted_prediction_tokens,
                                          "rejected_prediction_tokens": usage.rejected_prediction_tokens}}
    if prices is not None:
        body["cost"], body["cost_details"] = prices.cost(usage), prices.cost_details(usage)
    return body


def tool_calls_json(calls, first_index: int = 0) -> list[dict]:
    return [{"index": first_index + i, "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


def chat_logprobs_json(logprobs: list[TokenLogprob]) -> dict:
    return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.top]}
                        for lp in logprobs]}


class CompletionLogprobs:
    """OpenAI's legacy completions logprobs: tokens, their logprobs, top alternatives, offsets."""

    def __init__(self):
        self.offset = 0

    def json(self, logprobs: list[TokenLogprob]) -> dict:
        offsets = []
        for lp in logprobs:
            offsets.append(self.offset)
            self.offset += len(lp.token)
        return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
                                "top_logprobs": [_first_of_each(lp.top) for lp in logprobs], "text_offset": offsets}


def _first_of_each(top: list[tuple[str, float]]) -> dict[str, float]:
    """Token text -> logprob, most likely first. Two tokens may render alike (halves of one
    character): the likelier one stays."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(token, logprob)
    return out


async def _body(request: Request) -> dict:
    length = int(request.headers.get("content-length") or 0)
    if length > MAX_BODY_BYTES:
        if length <= DRAIN_LIMIT_BYTES:  # a client still sending when we answer sees a reset instead
            async for _ in request.stream():
                pass
        raise _TooLarge(f"the request body ({length} bytes) is over the limit of {MAX_BODY_BYTES} bytes")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise _TooLarge(f"the request body is over the limit of {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise invalid("the request body is not valid UTF-8") from None
    except ValueError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


class _TooLarge(GatewayError):
    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


def _parse(model_class, body: dict):
    try:
        return model_class.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = f"unrecognized request argument supplied: {where}"
        elif where:
            message = f"{where}: {message}"
        raise invalid(message) from None


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _cancelled_on_disconnect(request: Request, work):
    """Runs `work` (a coroutine) unless the client goes away first, which cancels it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if not task.cancelled() else Response(status_code=499)


class OpenAIApp:
    def __init__(self, frontend: Frontend, metrics_path: bool = True):
        self.frontend = frontend
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        if metrics_path:
            routes.append(Route("/metrics", self.metrics, methods=["GET"]))
        self.app = Starlette(routes=routes, exception_handlers={404: self._not_found, 405: self._not_found})

    @property
    def model(self):
        return self.frontend.model

    async def _not_found(self, request: Request, exc) -> JSONResponse:
        return error_response(GatewayError(grpc.StatusCode.NOT_FOUND, f"no route for {request.method} {request.url.path}"))

    async def models(self, request: Request) -> JSONResponse:
        try:
            self.frontend.authenticate(request.headers.get("authorization"))
        except GatewayError as exc:
            return error_response(exc)
        return JSONResponse({"object": "list", "data": [{
            "id": self.model.name, "object": "model", "created": 0, "owned_by": "tandem",
            "max_model_len": self.model.max_model_len}]})

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.frontend.draining else 200)

    async def metrics(self, request: Request) -> Response:
        return Response(prometheus_client.generate_latest(metrics.REGISTRY), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionBody, requests.chat, "chat.completions", self._chat_json,
                                 self._chat_chunks)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionBody, requests.completion, "completions",
                                 self._completion_json, self._completion_chunks)

    async def _serve(self, request: Request, body_class, prepare, span_name: str, unary, chunks) -> Response:
        try:
            caller = self.frontend.authenticate(request.headers.get("authorization"))
            body = _parse(body_class, await _body(request))
            prepared = prepare(body.to_request(request.headers.get(requests.SESSION_HEADER, "")), self.model)
        except _TooLarge as exc:
            return error_response(exc, status=413)
        except GatewayError as exc:
            return error_response(exc)
        events = self.frontend.events(prepared, span_name, tracing.extract(request.headers.items()), caller)
        if body.stream:  # until its first event it may wait in the queue: leaving cancels that too
            return await _cancelled_on_disconnect(request, self._stream(chunks(prepared, body, events)))
        return await _cancelled_on_disconnect(request, self._unary(unary(prepared, events)))

    @staticmethod
    async def _unary(work) -> Response:
        try:
            return JSONResponse(await work)
        except GatewayError as exc:
            return error_response(exc)

    @staticmethod
    async def _stream(chunks: AsyncIterator[dict]) -> Response:
        try:
            first = await anext(chunks)
        except GatewayError as exc:  # refused before anything was sent: a plain error response
            return error_response(exc)

        async def sse() -> AsyncIterator[bytes]:
            try:
                yield _event(first)
                async for chunk in chunks:
                    yield _event(chunk)
                yield b"data: [DONE]\n\n"
            except GatewayError as exc:
                yield _event(error_body(exc)[1])
            finally:
                await chunks.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "Connection": "close"})

    # Chat completions.

    async def _chat_json(self, prepared, events) -> dict:
        choices = [{"index": i, "text": [], "calls": [], "logprobs": [], "reason": None}
                   for i in range(len(prepared.generations))]
        usages = Usages(prepared.n)
        async for event in events:
            choice = choices[event.index]
            if isinstance(event, Delta):
                choice["text"].append(event.text)
                choice["calls"] += event.tool_calls
                choice["logprobs"] += event.logprobs
            else:
                choice["reason"] = event.reason
                usages.add(event)
        return {"id": prepared.request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model.name, "usage": usage_json(usages.total(), self.frontend.prices), "choices": [{
                    "index": c["index"], "finish_reason": c["reason"],
                    "logprobs": chat_logprobs_json(c["logprobs"]) if c["logprobs"] else None,
                    "message": {"role": "assistant", "content": "".join(c["text"]),
                                **({"tool_calls": tool_calls_json(c["calls"])} if c["calls"] else {})}}
                    for c in choices]}

    async def _chat_chunks(self, prepared, body: ChatCompletionBody, events: AsyncIterator[Event]):
        head = {"id": prepared.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model.name}

        def chunk(index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
            if logprobs:
                choice["logprobs"] = chat_logprobs_json(logprobs)
            return {**head, "choices": [choice]}

        num_calls = [0] * len(prepared.generations)
        usages = Usages(prepared.n)
        started = set()
        async for event in events:
            if event.index not in started:  # the role comes with the choice's first event
                started.add(event.index)
                yield chunk(event.index, {"role": "assistant", "content": ""})
            if isinstance(event, Finish):
                usages.add(event)
                yield chunk(event.index, {}, event.reason)
            elif event.text or event.tool_calls or event.logprobs:
                delta = {"content": event.text} if event.text else {}
                if event.tool_calls:
                    delta["tool_calls"] = tool_calls_json(event.tool_calls, num_calls[event.index])
                    num_calls[event.index] += len(event.tool_calls)
                yield chunk(event.index, delta, logprobs=event.logprobs)
        if body.include_usage:
            yield {**head, "choices": [], "usage": usage_json(usages.total(), self.frontend.prices)}

    # Completions.

    async def _completion_json(self, prepared, events) -> dict:
        choices = [{"index": i, "text": [], "logprobs": [], "reason": None} for i in range(len(prepared.generations))]
        usages = Usages(prepared.n)
        async for event in events:
            choice = choices[event.index]
            if isinstance(event, Delta):
                choice["text"].append(event.text)
                choice["logprobs"] += event.logprobs
            else:
                choice["reason"] = event.reason
                usages.add(event)
        wants_logprobs = prepared.generations[0].sampling.logprobs
        return {"id": prepared.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model.name, "usage": usage_json(usages.total(), self.frontend.prices), "choices": [{
                    "index": c["index"], "text": "".join(c["text"]), "finish_reason": c["reason"],
                    "logprobs": CompletionLogprobs().json(c["logprobs"]) if wants_logprobs else None}
                    for c in choices]}

    async def _completion_chunks(self, prepared, body: CompletionBody, events: AsyncIterator[Event]):
        head = {"id": prepared.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model.name}
        offsets = [CompletionLogprobs() for _ in prepared.generations]
        wants_logprobs = prepared.generations[0].sampling.logprobs
        usages = Usages(prepared.n)
        async for event in events:
            if isinstance(event, Finish):
                usages.add(event)
                yield {**head, "choices": [{"index": event.index, "text": "", "finish_reason": event.reason,
                                            "logprobs": None}]}
            elif event.text or event.logprobs:
                logprobs = offsets[event.index].json(event.logprobs) if wants_logprobs else None
                yield {**head, "choices": [{"index": event.index, "text": event.text, "finish_reason": None,
                                            "logprobs": logprobs}]}
        if body.include_usage:
            yield {**head, "choices": [], "usage": usage_json(usages.total(), self.frontend.prices)}


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
