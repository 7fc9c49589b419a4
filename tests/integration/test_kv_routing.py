"""KV-aware routing with real workers: prompts go where their prefix is cached, a popular
shared prefix still spreads, a session sticks to its worker until it dies, and a restarted
worker's old blocks are gone from the index."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deploy.processes import start_service
from deploy.stack import start_stack
from tandem.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

WORKER_ARGS = ("--kv-cache-bytes", str(8 << 20))
BLOCK = 16
HANG_GUARD_S = 30


def served(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return (
            worker_pb2_grpc.WorkerStub(channel)
            .Health(worker_pb2.HealthRequest(), timeout=5)
            .num_requests
        )


def gateway_health(stack) -> inference_pb2.HealthCheckResponse:
    with grpc.insecure_channel(stack.gateway_address) as channel:
        return inference_pb2_grpc.InferenceStub(channel).Health(
            inference_pb2.HealthCheckRequest(), timeout=5
        )


def cached_blocks(stack) -> dict[str, int]:
    return {w.address: w.num_cached_blocks for w in gateway_health(stack).workers}


def wait_until(predicate, what: str):
    deadline = time.monotonic() + HANG_GUARD_S
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def complete(address: str, prompt: list[int], max_tokens: int = 2, session: str = "") -> dict:
    request = urllib.request.Request(
        f"http://{address}/v1/completions",
        headers={
            "Content-Type": "application/json",
            **({"x-session-affinity": session} if session else {}),
        },
        data=json.dumps(
            {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        ).encode(),
    )
    with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
        return json.load(response)


def ran_on(stack, send) -> tuple[str, object]:
    """Which worker served `send()` (the workers' own counts), and what it returned."""
    before = {a: served(a) for a in stack.workers["both"]}
    result = send()
    [worker] = [a for a in stack.workers["both"] if served(a) > before[a]]
    return worker, result


@pytest.fixture(scope="module")
def stack(chat_checkpoint):
    local = start_stack(str(chat_checkpoint), num_workers=2, worker_args=WORKER_ARGS)
    yield local
    local.stop()


def test_prompts_go_to_the_worker_holding_their_prefix(stack):
    rng = random.Random(1)
    prefix = [rng.randrange(3, 380) for _ in range(20 * BLOCK)]
    # cold
    ran_on(
        stack, lambda: complete(stack.openai_address, [rng.randrange(3, 380) for _ in range(40)])
    )
    holder, _ = ran_on(stack, lambda: complete(stack.openai_address, prefix + [7] * 20))
    wait_until(
        lambda: cached_blocks(stack)[holder] >= 20, "the holder's KV events to reach the index"
    )
    for tail in ([9] * 30, [11] * 25):
        worker, reply = ran_on(stack, lambda: complete(stack.openai_address, prefix + tail))
        assert worker == holder
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 20 * BLOCK


def test_a_burst_sharing_one_system_prompt_spreads_over_the_workers(stack):
    system = [5] * (20 * BLOCK)
    before = {a: served(a) for a in stack.workers["both"]}
    with ThreadPoolExecutor(40) as pool:
        list(
            pool.map(
                lambda i: complete(stack.openai_address, system + [100 + i] * 8, max_tokens=60),
                range(40),
            )
        )
    counts = [served(a) - before[a] for a in stack.workers["both"]]
    assert sum(counts) == 40 and max(counts) / (sum(counts) / len(counts)) < 1.5, counts


def grpc_chat(address: str, content: str, session: str) -> None:
    request = inference_pb2.ChatCompletionRequest(max_tokens=2)
    message = request.messages.add(role="user")
    message.content.string_value = content
    with grpc.insecure_channel(address) as channel:
        inference_pb2_grpc.InferenceStub(channel).CreateChatCompletion(
            request, metadata=(("x-session-affinity", session),), timeout=HANG_GUARD_S
        )


def rest_chat(address: str, content: str, session: str) -> None:
    request = urllib.request.Request(
        f"http://{address}/tandem/v1/chat/completions",
        headers={"Content-Type": "application/json", "x-session-affinity": session},
        data=json.dumps(
            {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
        ).encode(),
    )
    urllib.request.urlopen(request, timeout=HANG_GUARD_S).read()


def test_a_session_sticks_to_its_worker_over_http_rest_and_grpc_until_it_dies(chat_checkpoint):
    local = start_stack(str(chat_checkpoint), num_workers=2, worker_args=WORKER_ARGS)
    try:
        rng = random.Random(2)
        sends = [
            lambda: complete(
                local.envoy_address, [rng.randrange(3, 380) for _ in range(30)], session="s-1"
            ),
            lambda: rest_chat(local.envoy_address, f"the fox {rng.random()}", "s-1"),
            lambda: grpc_chat(local.envoy_address, f"the dog {rng.random()}", "s-1"),
        ]
        home, _ = ran_on(local, sends[0])
        for send in sends * 3:  # fresh prompts: no cache pulls them anywhere, the session does
            assert ran_on(local, send)[0] == home
        assert gateway_health(local).routing.num_affinity_hits >= 9
        local.worker_processes[home].kill()
        other = next(a for a in local.workers["both"] if a != home)
        for send in sends:  # the session's worker is gone: served elsewhere, no error
            before = served(other)
            send()
            assert served(other) == before + 1
    finally:
        local.stop()


def test_a_restarted_worker_leaves_no_stale_blocks_in_the_index(chat_checkpoint):
    local = start_stack(str(chat_checkpoint), num_workers=2, worker_args=WORKER_ARGS)
    try:
        prefix = [13] * (10 * BLOCK)
        holder, _ = ran_on(local, lambda: complete(local.openai_address, prefix + [1, 2, 3]))
        wait_until(
            lambda: cached_blocks(local)[holder] >= 10, "the index to learn the holder's blocks"
        )
        local.worker_processes[holder].kill()
        wait_until(
            lambda: cached_blocks(local).get(holder, -1) == 0,
            "the dead worker's blocks to leave the index",
        )
        port = holder.rsplit(":", 1)[1]
        restarted, _ = start_service(
            "services.worker", "--model", str(chat_checkpoint), "--port", port, *WORKER_ARGS
        )
        local.processes.append(restarted)
        local.worker_processes[holder] = restarted
        wait_until(
            lambda: any(w.address == holder and w.healthy for w in gateway_health(local).workers),
            "the restarted worker to be routable",
        )
        # the new incarnation's snapshot: nothing of the old one
        assert cached_blocks(local)[holder] == 0
        reply = complete(local.openai_address, prefix + [4, 5, 6])
        # routed on no stale entry
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        local.stop()
