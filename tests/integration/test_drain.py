"""Rolling restarts under a streaming load lose no stream: a new worker joins, the old one gets
SIGTERM, drains (finishes its streams, refuses new work, which the gateway re-routes) and
exits 0. Colocated (the worker role) and disaggregated (the decode role)."""

from __future__ import annotations

import http.client
import json
import threading
import time

import grpc
import pytest

from deploy.stack import start_stack
from tandem.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

WORKER_ARGS = ("--kv-cache-bytes", str(8 << 20), "--kv-timeout-s", "60")
NUM_CLIENTS = 4
HANG_GUARD_S = 60


class StreamingLoad:
    """Clients that each stream chats one after another until stopped; every stream's last
    event is recorded, so a lost or broken stream shows."""

    def __init__(self, address: str):
        self.address = address
        self.endings: list[bytes] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, daemon=True) for _ in range(NUM_CLIENTS)
        ]

    def _client(self) -> None:
        host, port = self.address.split(":")
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": "the quick fox"}],
                "max_tokens": 60,
                "ignore_eos": True,
                "stream": True,
            }
        )
        while not self._stop.is_set():
            try:
                conn = http.client.HTTPConnection(host, int(port), timeout=HANG_GUARD_S)
                conn.request(
                    "POST",
                    "/v1/chat/completions",
                    body=body,
                    headers={"Content-Type": "application/json"},
                )
                response = conn.getresponse()
                if response.status != 200:
                    self.errors.append(f"HTTP {response.status}: {response.read()[:200]!r}")
                    continue
                data = [line[6:].strip() for line in response if line.startswith(b"data: ")]
                self.endings.append(data[-1] if data else b"")
                if not data or data[-1] != b"[DONE]":
                    self.errors.append(f"stream ended with {data[-1] if data else b'nothing'!r}")
                conn.close()
            except OSError as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> StreamingLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(HANG_GUARD_S)


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def routable(stack, role: str) -> set[str]:
    with grpc.insecure_channel(stack.gateway_address) as channel:
        health = inference_pb2_grpc.InferenceStub(channel).Health(
            inference_pb2.HealthCheckRequest(), timeout=5
        )
    return {w.address for w in health.workers if w.role == role and w.healthy}


def running(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return (
            worker_pb2_grpc.WorkerStub(channel)
            .Health(worker_pb2.HealthRequest(), timeout=5)
            .num_running
        )


def roll(stack, role: str, model: str) -> None:
    """Replaces the first worker of `role` with a new one, as a rolling restart does."""
    old = stack.workers[role][0]
    new = stack.start_worker(role, model, "--host", "127.0.0.1", *WORKER_ARGS)
    stack.write_workers_file()
    wait_until(lambda: new in routable(stack, role), "the new worker to join")
    process = stack.worker_processes[old]
    wait_until(lambda: running(old) > 0, "streams in flight on the old worker")
    process.terminate()  # SIGTERM: drain
    wait_until(
        lambda: old not in routable(stack, role), "the gateway to route around the draining worker"
    )
    assert process.wait(timeout=HANG_GUARD_S) == 0
    stack.workers[role].remove(old)
    stack.write_workers_file()


@pytest.mark.parametrize("topology, role", [("colocated", "both"), ("disaggregated", "decode")])
def test_a_rolling_restart_under_load_loses_no_stream(chat_checkpoint, topology, role):
    stack = start_stack(
        str(chat_checkpoint),
        topology=topology,
        worker_args=WORKER_ARGS,
        gateway_args=("--request-timeout-s", "60"),
    )
    try:
        with StreamingLoad(stack.openai_address) as load:
            wait_until(lambda: len(load.endings) >= NUM_CLIENTS, "the load to flow")
            roll(stack, role, str(chat_checkpoint))
            done = len(load.endings)
            wait_until(
                lambda: len(load.endings) >= done + NUM_CLIENTS,
                "the load to flow on the new worker",
            )
        assert not load.errors, load.errors[:5]
        assert len(load.endings) >= 2 * NUM_CLIENTS
    finally:
        stack.stop()
