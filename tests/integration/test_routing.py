"""Routing with real workers. `load`: a worker busy with a long request gets no new requests
until it drains, then gets its share again. `kv` (the default): prompts go where their prefix
is cached, a popular shared prefix still spreads, `x-session-affinity` keeps a session on its
worker (HTTP, REST and gRPC) until that worker dies, and the index follows restarts."""

from __future__ import annotations

import threading

import grpc
import pytest
from google.protobuf import json_format

from deploy.stack import start_stack
from tandem.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc


@pytest.fixture(scope="module")
def two_workers(chat_checkpoint):
    stack = start_stack(
        str(chat_checkpoint),
        num_workers=2,
        worker_args=("--kv-cache-bytes", str(8 << 20)),
        gateway_args=("--request-timeout-s", "60", "--router", "load"),
    )
    channel = grpc.insecure_channel(stack.gateway_address)
    yield stack, inference_pb2_grpc.InferenceStub(channel)
    channel.close()
    stack.stop()


def chat(content: str, **fields) -> inference_pb2.ChatCompletionRequest:
    return json_format.ParseDict(
        {"messages": [{"role": "user", "content": content}], "temperature": 0, **fields},
        inference_pb2.ChatCompletionRequest(),
    )


def requests_served(address: str) -> int:
    """The worker's own count, so the test checks where requests ran, not only the router's view."""
    with grpc.insecure_channel(address) as channel:
        return (
            worker_pb2_grpc.WorkerStub(channel)
            .Health(worker_pb2.HealthRequest(), timeout=5)
            .num_requests
        )


def test_a_worker_with_a_long_request_gets_no_new_ones_until_it_drains(two_workers):
    stack, gateway = two_workers
    before = {a: requests_served(a) for a in stack.worker_addresses}
    long_call = gateway.StreamChatCompletion(chat("the lazy dog " * 20, max_tokens=420), timeout=60)
    next(long_call)  # the role chunk: the request is routed
    drained = threading.Event()
    threading.Thread(target=lambda: (list(long_call), drained.set()), daemon=True).start()

    workers = gateway.Health(inference_pb2.HealthCheckRequest(), timeout=5).workers
    [busy] = [
        w.address for w in workers if w.in_flight_prefill_tokens + w.in_flight_decode_tokens > 0
    ]
    [idle] = [a for a in stack.worker_addresses if a != busy]
    num_short = 0
    while num_short < 6 and not drained.is_set():
        gateway.CreateChatCompletion(chat("the fox", max_tokens=2), timeout=30)
        num_short += 1
    assert not drained.is_set(), "the long request ended too soon to show anything"
    assert requests_served(busy) - before[busy] == 1  # the long request alone
    assert requests_served(idle) - before[idle] == num_short

    assert drained.wait(60)
    gateway.CreateChatCompletion(chat("the fox", max_tokens=2), timeout=30)
    assert requests_served(busy) - before[busy] == 2  # drained: it takes new requests again
