"""A worker and a gateway as real processes, shared by the integration tests that need both."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass

import grpc
import pytest

from deploy.envoy.render import render, start_envoy
from tests.integration.processes import named_address, start_service, stop

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def envoy_address(services_stack):
    """Envoy in front of the stack's gateway: host:port of its public listener."""
    port, admin_port = free_port(), free_port()
    config = render(port, admin_port, services_stack.gateway_address, services_stack.openai_address)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "envoy.yaml")
        with open(path, "w") as f:
            f.write(config)
        proc = start_envoy(path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    proc.kill()
                    raise RuntimeError("envoy did not become ready")
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
        stop(proc)
