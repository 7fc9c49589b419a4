"""OpenAI's chat completions (`/v1/chat/completions`) and completions (`/v1/completions`)
as surfaces of the HTTP edge (http_app.py), and what the OpenAI-shaped surfaces share: the
error body with the HTTP status of the gRPC code (a refusal under load carries
`Retry-After`). The replies themselves are built in openai_replies.py, as the gRPC surface's
are. The body's `stream` field picks a unary reply or server-sent events (`data: {...}` ...
`data: [DONE]`), which a gRPC-JSON transcoder cannot express.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from starlette.responses import JSONResponse

from services.gateway.api import openai_replies
from services.gateway.api.http_app import Surface, parse_model
from services.gateway.api.openai_models import ChatCompletionBody, CompletionBody
from services.gateway.errors import GatewayError
from services.gateway.prepare import requests
from services.gateway.protocol import Event

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
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
    code = (
        "invalid_api_key" if exc.code == grpc.StatusCode.UNAUTHENTICATED else exc.code.name.lower()
    )
    return status, {"error": {"message": exc.message, "type": kind, "param": None, "code": code}}


class OpenAISurface(Surface):
    """What OpenAI's surfaces share: its error shape, and `[DONE]` after a stream."""

    done = b"data: [DONE]\n\n"

    def error_response(self, exc: GatewayError, status: int = 0) -> JSONResponse:
        return error_response(exc, status)

    def error_event(self, exc: GatewayError) -> dict:
        return error_body(exc)[1]


class ChatCompletions(OpenAISurface):
    path = "/v1/chat/completions"
    span_name = "chat.completions"

    def parse(self, body: dict) -> ChatCompletionBody:
        return parse_model(ChatCompletionBody, body)

    def prepare(self, parsed: ChatCompletionBody, session: str) -> requests.Prepared:
        return requests.chat(parsed.to_request(session), self.model)

    async def unary(
        self, prepared, parsed: ChatCompletionBody, events: AsyncIterator[Event]
    ) -> dict:
        return await openai_replies.chat_completion(
            prepared, self.model.name, self.frontend.prices, events
        )

    def chunks(
        self, prepared, parsed: ChatCompletionBody, events: AsyncIterator[Event]
    ) -> AsyncIterator[dict]:
        return openai_replies.chat_chunks(
            prepared, self.model.name, self.frontend.prices, events, parsed.include_usage
        )


class Completions(OpenAISurface):
    path = "/v1/completions"
    span_name = "completions"

    def parse(self, body: dict) -> CompletionBody:
        return parse_model(CompletionBody, body)

    def prepare(self, parsed: CompletionBody, session: str) -> requests.Prepared:
        return requests.completion(parsed.to_request(session), self.model)

    async def unary(self, prepared, parsed: CompletionBody, events: AsyncIterator[Event]) -> dict:
        return await openai_replies.completion(
            prepared, self.model.name, self.frontend.prices, events
        )

    def chunks(
        self, prepared, parsed: CompletionBody, events: AsyncIterator[Event]
    ) -> AsyncIterator[dict]:
        return openai_replies.completion_chunks(
            prepared, self.model.name, self.frontend.prices, events, parsed.include_usage
        )
