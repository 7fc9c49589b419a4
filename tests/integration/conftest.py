"""A worker and a gateway as real processes, shared by the integration tests that need both."""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass

import grpc
import pytest

from deploy.envoy.render import render, start_envoy
from deploy.processes import free_port, named_address, start_service, stop

KV_BYTES = 8 << 20


@dataclass
class Stack:
    folder: str
    gateway_address: str  # gRPC
    openai_address: str  # the gateway's OpenAI-compatible HTTP
    worker_address: str
    gateway_channel: grpc.Channel
    worker_channel: grpc.Channel


@pytest.fixture(scope="session")
def services_stack(chat_checkpoint):
    folder = str(chat_checkpoint)
    worker, worker_address = start_service("services.worker", "--model", folder, "--kv-cache-bytes", str(KV_BYTES))
    gateway, address = start_service("services.gateway", "--model", folder, "--workers", worker_address,
                                     "--request-timeout-s", "30")
    stack = Stack(folder, address, named_address(gateway, "openai"), worker_address,
                  grpc.insecure_channel(address), grpc.insecure_channel(worker_address))
    yield stack
    stack.gateway_channel.close()
    stack.worker_channel.close()
    stop(gateway)
    stop(worker)


@pytest.fixture(scope="session")
def envoy_address(services_stack):
    """Envoy in front of the stack's gateway: host:port of its public listener."""
    port, admin_port = free_port(), free_port()
    config = render(port, admin_port, services_stack.gateway_address, services_stack.openai_address)
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_envoy(config, tmp, admin_port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        yield f"127.0.0.1:{port}"
        stop(proc)
