"""Workers, a gateway and Envoy as real processes, shared by the integration tests."""

from __future__ import annotations

import http.client
import json
from dataclasses import dataclass

import grpc
import pytest

from deploy.stack import LocalStack, start_stack

KV_BYTES = 8 << 20


@dataclass
class Stack:
    folder: str
    processes: LocalStack
    gateway_channel: grpc.Channel
    worker_channel: grpc.Channel

    @property
    def gateway_address(self) -> str:
        return self.processes.gateway_address

    @property
    def openai_address(self) -> str:
        return self.processes.openai_address


@pytest.fixture(scope="session")
def services_stack(chat_checkpoint):
    folder = str(chat_checkpoint)
    local = start_stack(
        folder,
        worker_args=("--kv-cache-bytes", str(KV_BYTES)),
        gateway_args=("--request-timeout-s", "30"),
    )
    stack = Stack(
        folder,
        local,
        grpc.insecure_channel(local.gateway_address),
        grpc.insecure_channel(local.worker_addresses[0]),
    )
    yield stack
    stack.gateway_channel.close()
    stack.worker_channel.close()
    local.stop()


@pytest.fixture(scope="session")
def envoy_address(services_stack):
    """Envoy's public listener in front of the stack's gateway."""
    return services_stack.processes.envoy_address


def stream_killing_midway(
    openai_address: str, kill, after_events: int = 3, timeout_s: float = 60
) -> list[bytes]:
    """Streams a long greedy chat over OpenAI SSE, calls `kill()` after `after_events` events,
    and returns every event's data until the stream ends (a hang ends in the socket timeout)."""
    host, port = openai_address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    body = {
        "messages": [{"role": "user", "content": "the fox"}],
        "max_tokens": 450,
        "temperature": 0,
        "stream": True,
    }
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.status == 200
    events = []
    for line in response:
        if line.startswith(b"data: "):
            events.append(line[6:].strip())
            if len(events) == after_events:
                kill()
    return events
