"""Admission: more concurrent requests than the workers' batches queue and all complete; a
full queue refuses with 429 and Retry-After; a client that leaves the queue is gone at once."""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.stack import start_stack

BATCH = 2


@pytest.fixture(scope="module")
def small_batch_stack(chat_checkpoint):
    # Slowed steps (2 ms each): requests run long enough for a test to act while they do.
    stack = start_stack(
        str(chat_checkpoint),
        worker_args=("--kv-cache-bytes", str(8 << 20), "--max-num-seqs", str(BATCH)),
        gateway_args=("--request-timeout-s", "60", "--max-queued-requests", "3"),
        worker_env={"both": {"TANDEM_FAULTS": "step_delay_s=0.002"}},
    )
    yield stack
    stack.stop()


def stream_chat(address: str, max_tokens: int):
    """Status, headers and SSE data lines of one streamed chat over plain HTTP."""
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {
        "messages": [{"role": "user", "content": "the fox"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    conn.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    if response.status != 200:
        return response.status, response.headers, [response.read()]
    return (
        response.status,
        response.headers,
        [line[6:].strip() for line in response if line.startswith(b"data: ")],
    )


def gauge(address: str, name: str) -> float:
    conn = http.client.HTTPConnection(*address.split(":"), timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    return next(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def test_more_requests_than_the_batch_holds_queue_and_all_complete(small_batch_stack):
    # BATCH running + 3 queued: everything fits in the queue, so nothing is refused.
    with ThreadPoolExecutor(BATCH + 3) as pool:
        results = list(
            pool.map(lambda _: stream_chat(small_batch_stack.envoy_address, 40), range(BATCH + 3))
        )
    for status, _, lines in results:
        assert status == 200 and lines[-1] == b"[DONE]"
        assert sum(1 for line in lines if b'"finish_reason":"length"' in line) == 1


def test_a_full_queue_refuses_with_429_and_retry_after_then_serves_again(small_batch_stack):
    address = small_batch_stack.openai_address
    with ThreadPoolExecutor(BATCH + 3 + 4) as pool:
        admitted = [
            pool.submit(stream_chat, small_batch_stack.envoy_address, 400) for _ in range(BATCH + 3)
        ]
        # Synchronisation point: the batch is full and the queue holds 3 before the overflow comes.
        deadline = time.monotonic() + 20
        while (
            gauge(address, "tandem:num_requests_running") < BATCH
            or gauge(address, "tandem:num_requests_waiting") < 3
        ):
            assert time.monotonic() < deadline, "the batch and the queue never filled"
            time.sleep(0.01)
        overflow = [pool.submit(stream_chat, small_batch_stack.envoy_address, 5) for _ in range(4)]
        for future in overflow:
            status, headers, [body] = future.result()
            assert status == 429 and int(headers["Retry-After"]) >= 1
            assert "queue is full" in json.loads(body)["error"]["message"]
        for future in admitted:
            status, _, lines = future.result()
            assert status == 200 and lines[-1] == b"[DONE]"
    status, _, lines = stream_chat(small_batch_stack.envoy_address, 5)
    assert status == 200 and lines[-1] == b"[DONE]"


def test_a_client_that_disconnects_while_queued_leaves_the_queue(small_batch_stack):
    client = openai.OpenAI(
        base_url=f"http://{small_batch_stack.openai_address}/v1",
        api_key="-",
        max_retries=0,
        timeout=60,
    )
    args = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "fox"}],
        max_tokens=300,
        extra_body={"ignore_eos": True},
    )
    with ThreadPoolExecutor(BATCH) as pool:
        busy = [pool.submit(lambda: client.chat.completions.create(**args)) for _ in range(BATCH)]
        deadline = time.monotonic() + 20  # synchronisation point: the batch is full
        while gauge(small_batch_stack.openai_address, "tandem:num_requests_running") < BATCH:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        host, port = small_batch_stack.openai_address.split(":")
        body = json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        ).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            while gauge(small_batch_stack.openai_address, "tandem:num_requests_waiting") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        while gauge(small_batch_stack.openai_address, "tandem:num_requests_waiting") > 0:
            assert time.monotonic() < deadline, "the queue kept a client that had left"
            time.sleep(0.02)
        assert not any(f.done() for f in busy)  # it left the queue, not waited its turn
        assert gauge(small_batch_stack.openai_address, "tandem:num_requests_running") == BATCH
        assert all(f.result().choices[0].finish_reason == "length" for f in busy)
