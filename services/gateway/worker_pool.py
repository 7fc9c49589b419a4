"""The workers the gateway sends requests to, and one streaming call to one of them.

Picking is round-robin for now; token-aware load balancing replaces it with disaggregation.
Worker failures become gateway errors with the status a client should see: a worker that
is down or dies mid-stream is UNAVAILABLE, never a hang (every call has a deadline).
"""

from __future__ import annotations

import itertools
from typing import Iterator

import grpc

from services.gateway.errors import GatewayError
from tandem.v1 import worker_pb2, worker_pb2_grpc

PASSED_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}


class WorkerPool:
    def __init__(self, addresses: list[str], request_timeout_s: float):
        if not addresses:
            raise ValueError("at least one worker address is needed")
        self.addresses = list(addresses)
        self.request_timeout_s = request_timeout_s
        self.channels = [grpc.insecure_channel(a) for a in self.addresses]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self._next = itertools.cycle(range(len(self.stubs)))

    def health(self, timeout_s: float = 2.0) -> list[worker_pb2.HealthResponse | None]:
        results = []
        for stub in self.stubs:
            try:
                results.append(stub.Health(worker_pb2.HealthRequest(), timeout=timeout_s))
            except grpc.RpcError:
                results.append(None)
        return results

    def generate(self, request: worker_pb2.GenerateRequest, on_cancel) -> Iterator[worker_pb2.GenerateResponse]:
        """Streams the worker's responses. `on_cancel(callback)` registers the caller's
        cancellation hook, so a client that goes away cancels the worker call too."""
        stub = self.stubs[next(self._next)]
        call = stub.Generate(request, timeout=self.request_timeout_s)
        on_cancel(call.cancel)
        try:
            yield from call
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.CANCELLED:
                return
            if code not in PASSED_THROUGH:
                code = grpc.StatusCode.UNAVAILABLE
            raise GatewayError(code, f"worker: {exc.details()}") from None

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
