"""Nothing is left hanging: a client that leaves mid-stream, a worker that is down."""

from __future__ import annotations

import json
import socket
import time

import openai

from deploy.processes import free_port, named_address, start_service, stop
from deploy.stack import start_stack
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.conftest import stream_killing_midway


def test_http_client_that_disconnects_mid_stream_frees_the_workers_blocks(services_stack):
    worker = worker_pb2_grpc.WorkerStub(services_stack.worker_channel)
    aborted_before = worker.Health(worker_pb2.HealthRequest(), timeout=5).num_aborted
    host, port = services_stack.openai_address.split(":")
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "the fox"}],
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        received = b""
        while received.count(b"data: ") < 3:
            received += sock.recv(4096)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = worker.Health(worker_pb2.HealthRequest(), timeout=5)
        if health.num_aborted > aborted_before and health.num_free_blocks == health.num_blocks:
            break
        time.sleep(0.05)
    assert health.num_aborted == aborted_before + 1
    assert health.num_free_blocks == health.num_blocks and health.num_running == 0


def test_worker_down_is_503_unavailable_not_a_hang(chat_checkpoint):
    gateway, _ = start_service(
        "services.gateway",
        "--model",
        str(chat_checkpoint),
        "--workers",
        f"127.0.0.1:{free_port()}",
        "--request-timeout-s",
        "5",
    )
    try:
        client = openai.OpenAI(
            base_url=f"http://{named_address(gateway, 'openai')}/v1",
            api_key="none",
            max_retries=0,
            timeout=30,
        )
        try:  # a hang would end in the client's timeout (APITimeoutError), failing the test
            client.chat.completions.create(
                model=chat_checkpoint.name, messages=[{"role": "user", "content": "hi"}]
            )
            raise AssertionError("expected an error")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
            assert "worker" in exc.body["message"]
    finally:
        stop(gateway)


def test_worker_dying_mid_stream_ends_the_stream_with_an_error_event(chat_checkpoint):
    stack = start_stack(
        str(chat_checkpoint),
        worker_args=("--kv-cache-bytes", str(8 << 20)),
        gateway_args=("--request-timeout-s", "30"),
    )
    try:
        events = stream_killing_midway(stack.openai_address, stack.processes[0].kill)  # the worker
        assert events[-1] != b"[DONE]"
        error = json.loads(events[-1])["error"]
        assert error["code"] == "unavailable" and "worker" in error["message"]
    finally:
        stack.stop()


def test_http_client_that_disconnects_from_a_unary_call_frees_the_workers_blocks(services_stack):
    worker = worker_pb2_grpc.WorkerStub(services_stack.worker_channel)
    before = worker.Health(worker_pb2.HealthRequest(), timeout=5)
    host, port = services_stack.openai_address.split(":")
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "the fox"}],
            "max_tokens": 450,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        deadline = time.monotonic() + 10  # synchronisation point: the request is running
        while worker.Health(worker_pb2.HealthRequest(), timeout=5).num_running == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    deadline = time.monotonic() + 10
    while True:
        health = worker.Health(worker_pb2.HealthRequest(), timeout=5)
        if health.num_aborted > before.num_aborted and health.num_free_blocks == health.num_blocks:
            break
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)
    assert health.num_aborted == before.num_aborted + 1 and health.num_running == 0
