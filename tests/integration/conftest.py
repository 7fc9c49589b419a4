"""Workers, a gateway and Envoy as real processes, shared by the integration tests."""

from __future__ import annotations

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
    local = start_stack(folder, worker_args=("--kv-cache-bytes", str(KV_BYTES)),
                        gateway_args=("--request-timeout-s", "30"))
    stack = Stack(folder, local, grpc.insecure_channel(local.gateway_address),
                  grpc.insecure_channel(local.worker_addresses[0]))
    yield stack
    stack.gateway_channel.close()
    stack.worker_channel.close()
    local.stop()


@pytest.fixture(scope="session")
def envoy_address(services_stack):
    """Envoy's public listener in front of the stack's gateway."""
    return services_stack.processes.envoy_address
