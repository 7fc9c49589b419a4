"""Errors the gateway answers with: a gRPC status (Envoy and the HTTP adapter map it to HTTP)."""

from __future__ import annotations

import grpc


class GatewayError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, message)
