"""Errors the gateway answers with: a gRPC status (Envoy and the HTTP adapter map it to HTTP)."""

from __future__ import annotations

import re

import grpc


class GatewayError(Exception):
    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        retry_after_s: int | None = None,
        field: str = "",
    ):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # a refusal under load: when to try again
        self.field = field or field_of(message)  # the request field refused, for logs and metrics


class ContextLimit(GatewayError):
    """The prompt, or the prompt and max_tokens, do not fit the context: each API words it its own way."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, context: int, message: str):
        super().__init__(
            grpc.StatusCode.INVALID_ARGUMENT,
            message,
            field="max_tokens" if max_tokens else "messages",
        )
        self.prompt_tokens, self.max_tokens, self.context = prompt_tokens, max_tokens, context


def invalid(message: str, field: str = "") -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message, field=field)


# Content parts of other modalities, in each API's names: the engine serves text only (a
# multimodal checkpoint such as Kimi K2.5 is served without its vision tower).
MEDIA_PARTS = (
    "image_url",
    "image",
    "input_image",
    "input_audio",
    "audio",
    "file",
    "input_file",
    "document",
    "video",
)


def unsupported_part(kind, where: str, supported: str) -> GatewayError:
    """The refusal of a content part: for an image, audio or file, which input is missing."""
    if kind in MEDIA_PARTS:
        return invalid(
            f"{where}: {kind!r} content is not supported: tandem serves text only (a multimodal "
            f"checkpoint's vision and audio encoders are not loaded); send {supported} parts"
        )
    return invalid(f"{where}: {kind!r} content is not supported here ({supported})")


def field_of(message: str) -> str:
    """The field a refusal names, from its usual shapes ("tools.3: ...", "unrecognized request
    argument supplied: client_metadata"), indices as N so the metric's labels stay few; "" if none."""
    head = message.removeprefix("unrecognized request argument supplied: ")
    head = head.split(":", 1)[0] if ":" in head else head
    head = re.sub(r"\[(\d+)\]|\.(\d+)(?=\.|$)", ".N", head.strip())
    return head if re.fullmatch(r"[A-Za-z_][\w.]*", head) and len(head) <= 64 else ""
