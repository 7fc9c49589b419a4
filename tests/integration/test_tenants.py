"""Tenants sharing one keyed stack (issue 28): the public /metrics wants a key with the metrics
scope while the gateway's own port stays open; a key with 200 requests queued does not hold
back another key's first tokens; a key past max_concurrent_requests gets 429 with
Retry-After; and Envoy, capped at a few connections, refuses the excess of a flood of idle
connections and closes the idle ones while a client it serves keeps being answered."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.envoy.render import render, start_envoy
from deploy.processes import free_port, stop
from deploy.stack import start_stack
from services.gateway.api_keys import add_key

BATCH = 2
DEADLINE_S = 60  # a hang guard for every poll below, never a measurement


@pytest.fixture(scope="module")
def tenants(chat_checkpoint, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tenants") / "keys.json")
    keys = {
        "ops": add_key(path, "ops", scopes=("metrics",)),
        "a": add_key(path, "a"),
        "b": add_key(path, "b"),
        "capped": add_key(path, "capped", max_concurrent_requests=1),
    }
    # Slowed steps (10 ms each) and a batch of 2: requests queue, and run long enough to act on.
    stack = start_stack(
        str(chat_checkpoint),
        worker_args=("--kv-cache-bytes", str(8 << 20), "--max-num-seqs", str(BATCH)),
        gateway_args=("--api-keys-file", path, "--request-timeout-s", "120"),
        worker_env={"both": {"TANDEM_FAULTS": "step_delay_s=0.01"}},
    )
    yield stack, keys
    stack.stop()


def get(address: str, path: str, key: str | None = None, **headers) -> tuple[int, bytes]:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"http://{address}{path}", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def chat(max_tokens: int) -> dict:
    return {
        "messages": [{"role": "user", "content": "the fox"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


def test_public_metrics_want_a_metrics_key_and_the_private_port_does_not(tenants):
    stack, keys = tenants
    status, body = get(stack.envoy_address, "/metrics")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    # a client cannot pass for the private side: Envoy overwrites the mark
    assert get(stack.envoy_address, "/metrics", **{"x-tandem-edge": "private"})[0] == 401
    status, body = get(stack.envoy_address, "/metrics", keys["a"])  # a tenant's key
    assert status == 403 and "metrics scope" in json.loads(body)["error"]["message"]
    status, body = get(stack.envoy_address, "/metrics", keys["ops"])
    assert status == 200 and b"tandem:api_key_requests_total" in body
    status, body = get(stack.openai_address, "/metrics")  # Prometheus's port: as before
    assert status == 200 and b"tandem:num_requests_waiting" in body


async def waiting(client: httpx.AsyncClient, address: str, key: str) -> float:
    text = (await client.get(f"http://{address}/metrics")).text
    return next(
        (
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "tandem:num_requests_waiting" and s.labels == {"key": key}
        ),
        0.0,
    )


async def until(condition) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.05)


async def stream(client, address: str, key: str, max_tokens: int, first: asyncio.Event | None):
    """One streamed chat to its end; `first` is set when its first token arrives."""
    async with client.stream(
        "POST",
        f"http://{address}/v1/chat/completions",
        json=chat(max_tokens),
        headers={"Authorization": f"Bearer {key}"},
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and first is not None:
                first.set()


def test_a_key_with_200_queued_does_not_hold_back_another_keys_first_tokens(tenants):
    stack, keys = tenants
    address = stack.openai_address

    async def scenario():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            held = [asyncio.Event() for _ in range(BATCH)]
            holders = [
                asyncio.create_task(stream(client, address, keys["a"], 400, e)) for e in held
            ]
            await asyncio.gather(*(e.wait() for e in held))  # a's two fill the batch
            queued_a = [
                asyncio.create_task(stream(client, address, keys["a"], 20, None))
                for _ in range(200)
            ]
            await until(lambda: _equals(waiting(client, address, "a"), 200))
            firsts = [asyncio.Event() for _ in range(5)]
            b = [asyncio.create_task(stream(client, address, keys["b"], 5, e)) for e in firsts]
            await until(lambda: _equals(waiting(client, address, "b"), 5))  # behind a's 200
            for task in holders:  # the batch frees: the queues take turns from here
                task.cancel()
            await asyncio.gather(*(e.wait() for e in firsts))
            # every b request has its first token while a's queue is nowhere near drained
            assert await waiting(client, address, "a") >= 150
            await asyncio.gather(*b)
            for task in queued_a:
                task.cancel()
            await asyncio.gather(*holders, *queued_a, return_exceptions=True)
            await until(lambda: _equals(waiting(client, address, "a"), 0))

    asyncio.run(scenario())


async def _equals(value, expected) -> bool:
    return await value == expected


def test_past_max_concurrent_requests_a_key_gets_429_with_retry_after(tenants):
    stack, keys = tenants
    address = stack.openai_address

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            first = asyncio.Event()
            running = asyncio.create_task(stream(client, address, keys["capped"], 400, first))
            await first.wait()
            response = await client.post(
                f"http://{address}/v1/chat/completions",
                json=chat(5),
                headers={"Authorization": f"Bearer {keys['capped']}"},
            )
            assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1
            assert "1 requests in flight" in response.json()["error"]["message"]
            running.cancel()  # its client leaves: the key's place is free again
            await asyncio.gather(running, return_exceptions=True)

            async def served() -> bool:
                again = await client.post(
                    f"http://{address}/v1/chat/completions",
                    json={**chat(2), "stream": False},
                    headers={"Authorization": f"Bearer {keys['capped']}"},
                )
                return again.status_code == 200

            await until(served)

    asyncio.run(scenario())


def envoy_stats(admin_port: int, *names: str) -> dict[str, int]:
    """Envoy's counters whose names end in one of `names`, summed over listeners."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats", timeout=10).read()
    totals = dict.fromkeys(names, 0)
    for line in text.decode().splitlines():
        stat, _, value = line.partition(": ")
        for name in names:
            if stat.endswith(name) and value.strip().isdigit():
                totals[name] += int(value)
    return totals


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether Envoy closed `sock` (it sends nothing but, for a half-sent request, a 408)."""
    try:
        while data := sock.recv(4096):
            assert data.startswith(b"HTTP/1.1 408"), data
        return True
    except ConnectionResetError:
        return True


def test_envoy_refuses_connections_past_its_cap_and_closes_idle_ones_while_serving(tenants):
    stack, keys = tenants
    cap, idle = 4, 5  # 1 client being served + 3 idle reach the cap; 2 more are over it
    port, admin = free_port(), free_port()
    config = render(
        port,
        admin,
        stack.gateway_address,
        stack.openai_address,
        max_connections=cap,
        idle_timeout_s=2,
        headers_timeout_s=2,
    )
    with tempfile.TemporaryDirectory() as workdir:
        envoy = start_envoy(
            config, workdir, admin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    sockets = []
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        with client.stream(
            "POST",
            "/v1/chat/completions",
            json=chat(100),
            headers={"Authorization": f"Bearer {keys['a']}"},
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            # the flood: connections that send nothing, and one that never finishes its headers
            for i in range(idle + 1):
                sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
                sockets.append(sock)
                if i == 0:
                    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            counts = envoy_stats(admin, "downstream_global_cx_overflow")
            deadline = time.monotonic() + DEADLINE_S
            while counts["downstream_global_cx_overflow"] < idle + 1 - (cap - 1):
                assert time.monotonic() < deadline, counts
                time.sleep(0.05)
                counts = envoy_stats(admin, "downstream_global_cx_overflow")
            rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"  # the served client's stream ran to its end
        # every connection of the flood is closed by Envoy: over the cap at once, the others
        # by the idle or the headers timeout (recv returns; a hang ends in the socket timeout)
        assert all(closed_by_peer(sock) for sock in sockets)
        counts = envoy_stats(
            admin,
            "downstream_global_cx_overflow",
            "downstream_cx_idle_timeout",
            "downstream_rq_header_timeout",
        )
        assert counts["downstream_global_cx_overflow"] == idle + 1 - (cap - 1)
        assert counts["downstream_rq_header_timeout"] + counts["downstream_cx_idle_timeout"] >= 3
        # and once they are gone, a new client is served
        response = client.get("/v1/models", headers={"Authorization": f"Bearer {keys['a']}"})
        assert response.status_code == 200
        client.close()
    finally:
        for sock in sockets:
            sock.close()
        stop(envoy)
