"""A worker and a gateway as real processes, shared by the integration tests that need both."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest

from tests.integration.processes import named_address, start_service, stop

KV_BYTES = 8 << 20


@dataclass
class Stack:
    folder: str
    gateway_address: str  # gRPC
    openai_url: str  # http://host:port/v1
    worker_address: str
    gateway_channel: grpc.Channel
    worker_channel: grpc.Channel


@pytest.fixture(scope="session")
def services_stack(chat_checkpoint):
    folder = str(chat_checkpoint)
    worker, worker_address = start_service("services.worker", "--model", folder, "--kv-cache-bytes", str(KV_BYTES))
    gateway, address = start_service("services.gateway", "--model", folder, "--workers", worker_address,
                                     "--request-timeout-s", "30")
    stack = Stack(folder, address, f"http://{named_address(gateway, 'openai')}/v1", worker_address,
                  grpc.insecure_channel(address), grpc.insecure_channel(worker_address))
    yield stack
    stack.gateway_channel.close()
    stack.worker_channel.close()
    stop(gateway)
    stop(worker)
