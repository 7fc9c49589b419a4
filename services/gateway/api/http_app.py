"""The gateway's HTTP edge on uvicorn + Starlette: each public API a `Surface` (a thin adapter
in a file of its own), plus /v1/models, /health and Prometheus /metrics.

Surfaces: OpenAI chat completions and completions (openai_api.py), OpenAI Responses
(responses_api.py), Anthropic Messages (messages_api.py). Each parses its JSON body into the
gateway's own request (protocol.py), runs it through the same frontend as gRPC, and writes
its events as JSON or server-sent events, with no protobuf on the way. This module holds what
they share: reading and bounding the body, the caller's key, the unary or streamed reply, and
cancellation. A stream's headers are sent with its first event, so a request refused while
queued gets a plain error response (429 under load); an error after that is sent as the
surface's error event, never as a silently truncated stream. A client that disconnects
cancels its generation, streamed or not.

/metrics answers anyone on the gateway's own HTTP port (the private one Prometheus scrapes).
Through Envoy's public port (which marks every request with PUBLIC_EDGE_HEADER) and with API
keys on, it needs a key with the `metrics` scope: the page names every key with its traffic
and spend. No key: 401; a key without the scope: 403.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import grpc
import prometheus_client
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from services import tracing
from services.gateway import metrics
from services.gateway.api_keys import METRICS_SCOPE
from services.gateway.errors import GatewayError, invalid
from services.gateway.frontend import Frontend
from services.gateway.prepare.requests import SESSION_HEADER, Prepared
from services.gateway.protocol import Event

log = logging.getLogger("tandem.gateway")

MAX_BODY_BYTES = 8 << 20
# what of a request was left out (hosted tools tandem cannot run)
WARNING_HEADER = "x-tandem-warning"
# an oversized body up to this is read and dropped, so the client sees the 413
DRAIN_LIMIT_BYTES = 64 << 20
# set (overwriting any a client sent) by Envoy on every request through the public port
PUBLIC_EDGE_HEADER = "x-tandem-edge"


class TooLarge(GatewayError):
    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)


class Surface:
    """One public API: its body to the gateway's request, the events to its replies, its errors.

    `parse` returns the surface's own parsed request (whatever `unary` and `chunks` need) and
    `prepare` the Prepared the frontend runs. `chunks` yields the stream's events as dicts;
    with `named_events`, each is sent as `event: <its "type">` (Responses, Messages), else as
    a bare `data:` line; `done` is sent after the last (OpenAI's `[DONE]`)."""

    path: str
    span_name: str
    named_events = False
    done: bytes | None = None

    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    @property
    def model(self):
        return self.frontend.model

    def authorization(self, request: Request) -> str | None:
        return request.headers.get("authorization")

    def parse(self, body: dict) -> Any:
        raise NotImplementedError

    def prepare(self, parsed: Any, session: str) -> Prepared:
        """`session`: the request's x-session-affinity."""
        raise NotImplementedError

    def stream(self, parsed: Any) -> bool:
        return bool(getattr(parsed, "stream", False))

    async def unary(self, prepared: Prepared, parsed: Any, events: AsyncIterator[Event]) -> dict:
        raise NotImplementedError

    def chunks(
        self, prepared: Prepared, parsed: Any, events: AsyncIterator[Event]
    ) -> AsyncIterator[dict]:
        raise NotImplementedError

    def error_response(self, exc: GatewayError, status: int = 0) -> JSONResponse:
        raise NotImplementedError

    def error_event(self, exc: GatewayError) -> dict:
        raise NotImplementedError

    def routes(self) -> list[Route]:
        """Routes besides `path` (Messages' count_tokens)."""
        return []

    def refused(self, exc: GatewayError, status: int = 0) -> JSONResponse:
        """The error response, logged in one line and counted by surface, field and status."""
        response = self.error_response(exc, status)
        log.info(
            "refused %s %s: %s%s",
            self.path,
            response.status_code,
            f"{exc.field}: " if exc.field and not exc.message.startswith(exc.field) else "",
            exc.message,
        )
        metrics.REFUSED.labels(self.span_name, exc.field, str(response.status_code)).inc()
        return response

    def encode(self, event: dict) -> bytes:
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode()
        if self.named_events:
            return b"event: " + event["type"].encode() + b"\ndata: " + data + b"\n\n"
        return b"data: " + data + b"\n\n"


def parse_model(model_class, body: dict, errors_as: str = "openai"):
    """A pydantic body model from `body`; a 400 naming the first problem."""
    try:
        return model_class.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = (
                f"unrecognized request argument supplied: {where}"
                if errors_as == "openai"
                else f"{where}: Extra inputs are not permitted"
            )
        elif where:
            message = f"{where}: {message}"
        raise invalid(message, field=re.sub(r"\.\d+(?=\.|$)", ".N", where)) from None


async def read_body(request: Request) -> dict:
    length = int(request.headers.get("content-length") or 0)
    if length > MAX_BODY_BYTES:
        if (
            length <= DRAIN_LIMIT_BYTES
        ):  # a client still sending when we answer sees a reset instead
            async for _ in request.stream():
                pass
        raise TooLarge(
            f"the request body ({length} bytes) is over the limit of {MAX_BODY_BYTES} bytes"
        )
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise TooLarge(f"the request body is over the limit of {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise invalid("the request body is not valid UTF-8") from None
    except ValueError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


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


class HttpApp:
    def __init__(self, frontend: Frontend, surfaces: list[Surface], metrics_path: bool = True):
        self.frontend = frontend
        self.surfaces = surfaces
        routes = [Route(s.path, self._endpoint(s), methods=["POST"]) for s in surfaces]
        routes += [r for s in surfaces for r in s.routes()]
        routes += [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/", self.root, methods=["GET", "HEAD"]),
        ]
        if metrics_path:
            routes.append(Route("/metrics", self.metrics, methods=["GET"]))
        self.app = Starlette(
            routes=routes, exception_handlers={404: self._not_found, 405: self._not_found}
        )

    async def _not_found(self, request: Request, exc) -> JSONResponse:
        error = GatewayError(
            grpc.StatusCode.NOT_FOUND, f"no route for {request.method} {request.url.path}"
        )
        surface = next(
            (s for s in self.surfaces if request.url.path.startswith(s.path)), self.surfaces[0]
        )
        return surface.error_response(error)

    async def models(self, request: Request) -> JSONResponse:
        surface = self.surfaces[0]
        try:
            self.frontend.authenticate(surface.authorization(request))
        except GatewayError as exc:
            return surface.error_response(exc)
        model = self.frontend.model
        # One list for both APIs: OpenAI's fields and Anthropic's (type, display_name, created_at,
        # has_more, first_id, last_id), with the context length as vLLM names it.
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": model.name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "tandem",
                        "max_model_len": model.max_model_len,
                        "type": "model",
                        "display_name": model.name,
                        "created_at": "1970-01-01T00:00:00Z",
                    }
                ],
                "has_more": False,
                "first_id": model.name,
                "last_id": model.name,
            }
        )

    async def root(self, request: Request) -> Response:
        """Clients' reachability probe (Claude Code sends HEAD /)."""
        return JSONResponse({"status": "ok", "model": self.frontend.model.name})

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.frontend.draining else 200)

    async def metrics(self, request: Request) -> Response:
        if request.headers.get(PUBLIC_EDGE_HEADER) == "public":
            try:
                caller = self.frontend.authenticate(request.headers.get("authorization"))
                if caller is not None and METRICS_SCOPE not in caller.entry.scopes:
                    raise GatewayError(
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"API key {caller.name!r} may not read /metrics on the public port: give "
                        'it the metrics scope ("scopes": ["metrics"] in the keys file)',
                    )
            except GatewayError as exc:
                return self.surfaces[0].error_response(exc)
        return Response(
            prometheus_client.generate_latest(metrics.REGISTRY),
            media_type=prometheus_client.CONTENT_TYPE_LATEST,
        )

    def _endpoint(self, surface: Surface):
        async def serve(request: Request) -> Response:
            try:
                caller = self.frontend.authenticate(surface.authorization(request))
                parsed = surface.parse(await read_body(request))
                prepared = surface.prepare(parsed, request.headers.get(SESSION_HEADER, ""))
            except TooLarge as exc:
                return surface.refused(exc, status=413)
            except GatewayError as exc:
                return surface.refused(exc)
            events = self.frontend.events(
                prepared, surface.span_name, tracing.extract(request.headers.items()), caller
            )
            headers = {WARNING_HEADER: prepared.warning} if prepared.warning else {}
            if surface.stream(
                parsed
            ):  # until its first event it may wait in the queue: leaving cancels that too
                return await _cancelled_on_disconnect(
                    request, _stream(surface, surface.chunks(prepared, parsed, events), headers)
                )
            return await _cancelled_on_disconnect(
                request, _unary(surface, surface.unary(prepared, parsed, events), headers)
            )

        return serve


async def _unary(surface: Surface, work, headers: dict) -> Response:
    try:
        return JSONResponse(await work, headers=headers)
    except GatewayError as exc:
        return surface.refused(exc)


async def _stream(surface: Surface, chunks: AsyncIterator[dict], headers: dict) -> Response:
    try:
        first = await anext(chunks)
    except GatewayError as exc:  # refused before anything was sent: a plain error response
        return surface.refused(exc)

    async def sse() -> AsyncIterator[bytes]:
        try:
            yield surface.encode(first)
            async for chunk in chunks:
                yield surface.encode(chunk)
            if surface.done:
                yield surface.done
        except GatewayError as exc:
            yield surface.encode(surface.error_event(exc))
        finally:
            await chunks.aclose()

    return StreamingResponse(
        sse(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "Connection": "close", **headers},
    )
