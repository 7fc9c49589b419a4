"""OpenAI-compatible HTTP: /v1/chat/completions, /v1/completions, /v1/models.

One OpenAI path serves both the unary and the streaming call (the body's `stream` field
picks), which a gRPC-JSON transcoder cannot express; so this small adapter parses the JSON
into the same protobuf requests and runs the same servicer methods as gRPC, then writes JSON
or server-sent events (`data: {...}` ... `data: [DONE]`). Errors use OpenAI's error body with
the HTTP status of the gRPC code. An error after streaming began is sent as an error event,
never as a silently truncated stream. A client that disconnects cancels its generation.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from google.protobuf import json_format

from services.gateway.errors import GatewayError, invalid
from services.gateway.servicer import InferenceServicer
from tandem.v1 import inference_pb2

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
DRAIN_LIMIT_BYTES = 64 << 20
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
ROUTES = {
    "/v1/chat/completions": (inference_pb2.ChatCompletionRequest, "CreateChatCompletion", "StreamChatCompletion"),
    "/v1/completions": (inference_pb2.CompletionRequest, "CreateCompletion", "StreamCompletion"),
}


class BodyTooLarge(Exception):
    """Answered with 413 before the body is read."""


class CallContext:
    """The part of grpc.ServicerContext the servicer uses, for calls that arrive over HTTP."""

    def __init__(self):
        self.callbacks = []

    def add_callback(self, callback) -> None:
        self.callbacks.append(callback)

    def abort(self, code: grpc.StatusCode, details: str):
        raise GatewayError(code, details)

    def cancel(self) -> None:
        for callback in self.callbacks:
            callback()


def error_body(code: grpc.StatusCode, message: str) -> tuple[int, dict]:
    status, kind = HTTP_STATUS.get(code, (500, "internal_error"))
    return status, {"error": {"message": message, "type": kind, "param": None, "code": code.name.lower()}}


def to_json(message) -> dict:
    """protobuf JSON, patched to OpenAI's conventions: int64 `created` as a number, `index` and
    `cached_tokens` present when 0, `finish_reason` null while unfinished."""
    body = json_format.MessageToDict(message, preserving_proto_field_name=True)
    if "created" in body:
        body["created"] = int(body["created"])
    if body.get("object", "").startswith(("chat.completion", "text_completion")):
        for choice in body.setdefault("choices", []):
            choice.setdefault("index", 0)
            choice["finish_reason"] = choice.get("finish_reason") or None
    if "usage" in body:
        body["usage"].setdefault("prompt_tokens_details", {}).setdefault("cached_tokens", 0)
    return body


class OpenAIHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    servicer: InferenceServicer  # set on the subclass made by `serve`

    def log_message(self, fmt, *args):  # quiet: one line per request at debug level
        log.debug("%s " + fmt, self.address_string(), *args)

    def do_GET(self):
        if self.path.rstrip("/") == "/v1/models":
            self._send_json(200, to_json(self.servicer.ListModels(inference_pb2.ListModelsRequest(), None)))
        else:
            self._send_json(*error_body(grpc.StatusCode.NOT_FOUND, f"no route for GET {self.path}"))

    def do_POST(self):
        route = ROUTES.get(self.path.rstrip("/"))
        if route is None:
            self._send_json(*error_body(grpc.StatusCode.NOT_FOUND, f"no route for POST {self.path}"))
            return
        try:
            body = self._read_json()
            request = json_format.ParseDict(body, route[0](), ignore_unknown_fields=True)
        except BodyTooLarge as exc:
            status, error = error_body(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self._send_json(413, error)
            return
        except GatewayError as exc:
            self._send_json(*error_body(exc.code, exc.message))
            return
        except json_format.ParseError as exc:
            self._send_json(*error_body(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {exc}"))
            return
        context = CallContext()
        if body.get("stream"):
            self._stream(getattr(self.servicer, route[2])(request, context), context)
            return
        try:
            reply = getattr(self.servicer, route[1])(request, context)
        except GatewayError as exc:
            self._send_json(*error_body(exc.code, exc.message))
            return
        self._send_json(200, to_json(reply))

    def _read_json(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            # Drain a moderately large body so the client can read the 413 (a client still
            # sending when we close sees a broken pipe instead); close past that.
            remaining = length if length <= DRAIN_LIMIT_BYTES else 0
            while remaining > 0:
                chunk = self.rfile.read(min(1 << 20, remaining))
                if not chunk:
                    break
                remaining -= len(chunk)
            self.close_connection = True
            raise BodyTooLarge(f"the request body ({length} bytes) is over the limit of {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise invalid("the request body is not valid UTF-8") from None
        except ValueError as exc:
            raise invalid(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        return body

    def _stream(self, chunks, context: CallContext) -> None:
        try:
            first = next(chunks)
        except GatewayError as exc:  # refused before anything was sent: a plain error response
            self._send_json(*error_body(exc.code, exc.message))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            self._event(to_json(first))
            for chunk in chunks:
                self._event(to_json(chunk))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except GatewayError as exc:
            self._event(error_body(exc.code, exc.message)[1])
        except OSError:  # the client went away: stop the generation and free its KV
            context.cancel()
            chunks.close()

    def _event(self, body: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n")
        self.wfile.flush()

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status, HTTPStatus(status).phrase)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(servicer: InferenceServicer, host: str, port: int) -> ThreadingHTTPServer:
    """Starts serving on a daemon thread; returns the server (its port in server_address)."""
    handler = type("BoundOpenAIHandler", (OpenAIHandler,), {"servicer": servicer})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="openai-http", daemon=True).start()
    return server
