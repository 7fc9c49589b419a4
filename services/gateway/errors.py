"""Errors the gateway answers with: a gRPC status (Envoy and the HTTP adapter map it to HTTP)."""

from __future__ import annotations

from typing import Optional

import grpc


class GatewayError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: Optional[int] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # a refusal under load: when to try again


def invalid(message: str) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message)
