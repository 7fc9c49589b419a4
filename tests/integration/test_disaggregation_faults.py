"""Disaggregation never hangs: real prefill and decode processes are killed before they
answer, mid-transfer and mid-stream; each request ends (retried, or with a clear error) in
bounded time, blocks are freed on both sides, and the system serves the next request.

The gateway reads its workers from the stack's workers file, which these tests rewrite to
put faulty workers (TANDEM_FAULTS) in front of it: the set changes at run time. The faults
during and after a transfer run on UCX and on Mooncake's Transfer Engine (`kv_transport`).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from deploy.stack import start_stack
from tandem.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.integration.conftest import stream_killing_midway

KV_BYTES = 8 << 20
WORKER_ARGS = ("--kv-cache-bytes", str(KV_BYTES), "--kv-timeout-s", "60")
BOTH_TRANSPORTS = pytest.mark.parametrize("kv_transport", ["ucx", "mooncake"], indirect=True)
# before any transfer: one stack (the UCX one) is enough
UCX_ONLY = pytest.mark.parametrize("kv_transport", ["ucx"], indirect=True)
HANG_GUARD_S = 60  # only catches a hang; the faults below resolve in a second or two
CONTENT = "the quick brown fox jumps over the lazy dog " * 4
# the tiny model prefills in milliseconds; a hung prefill worker is retried after this
PREFILL_TIMEOUT_S = 5


@pytest.fixture(scope="module")
def kv_transport(request) -> str:
    return request.param


def worker_args(kv_transport: str) -> tuple[str, ...]:
    return (*WORKER_ARGS, "--kv-transport", kv_transport)


@pytest.fixture(scope="module")
def stack(chat_checkpoint, kv_transport):
    # retries under test, not cache affinity
    local = start_stack(
        str(chat_checkpoint),
        topology="disaggregated",
        worker_args=worker_args(kv_transport),
        gateway_args=(
            "--request-timeout-s",
            "60",
            "--prefill-timeout-s",
            str(PREFILL_TIMEOUT_S),
            "--router",
            "load",
        ),
    )
    yield local
    local.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(
        base_url=f"http://{stack.openai_address}/v1",
        api_key="none",
        max_retries=0,
        timeout=HANG_GUARD_S,
    )


def health(address: str) -> worker_pb2.HealthResponse:
    with grpc.insecure_channel(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).Health(worker_pb2.HealthRequest(), timeout=5)


def wait_until(predicate, what: str, timeout_s: float = HANG_GUARD_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def publish(stack, prefill: list[str], decode: list[str]) -> None:
    """Rewrites the workers file and waits until the gateway routes to exactly these workers."""
    stack.workers.update(prefill=prefill, decode=decode)
    stack.write_workers_file()
    with grpc.insecure_channel(stack.gateway_address) as channel:
        gateway = inference_pb2_grpc.InferenceStub(channel)
        wanted = {(a, "prefill") for a in prefill} | {(a, "decode") for a in decode}

        def routes_to_wanted():
            workers = gateway.Health(inference_pb2.HealthCheckRequest(), timeout=5).workers
            return (
                {(w.address, w.role) for w in workers if w.healthy}
                == wanted
                == {(w.address, w.role) for w in workers}
            )

        wait_until(routes_to_wanted, "the gateway to route to the new workers")


def ask(client, model: str, max_tokens: int = 8) -> str:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": CONTENT}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return reply.choices[0].message.content


@UCX_ONLY
def test_prefill_killed_before_answering_is_retried_on_another(stack, client, chat_checkpoint):
    [healthy_prefill], [decode] = stack.workers["prefill"], stack.workers["decode"]
    expected = ask(client, chat_checkpoint.name)
    slow = stack.start_worker(
        "prefill", str(chat_checkpoint), *WORKER_ARGS, env={"TANDEM_FAULTS": "prefill_delay_s=600"}
    )
    stack.workers["prefill"].remove(slow)
    publish(stack, [slow], [decode])
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(ask, client, chat_checkpoint.name)
        wait_until(
            lambda: health(slow).num_requests == 1, "the slow prefill worker to take the request"
        )
        publish(stack, [slow, healthy_prefill], [decode])
        stack.worker_processes[slow].kill()
        killed_at = time.monotonic()
        assert reply.result(timeout=HANG_GUARD_S) == expected
    assert time.monotonic() - killed_at < HANG_GUARD_S
    publish(stack, [healthy_prefill], [decode])


@UCX_ONLY
def test_prefill_that_hangs_past_its_deadline_is_retried_on_another(stack, client, chat_checkpoint):
    [healthy_prefill], [decode] = stack.workers["prefill"], stack.workers["decode"]
    expected = ask(client, chat_checkpoint.name)
    hung = stack.start_worker(
        "prefill", str(chat_checkpoint), *WORKER_ARGS, env={"TANDEM_FAULTS": "prefill_delay_s=600"}
    )
    stack.workers["prefill"].remove(hung)
    # equal loads: the newcomer (fewer routed) goes first
    publish(stack, [hung, healthy_prefill], [decode])
    started = time.monotonic()
    assert ask(client, chat_checkpoint.name) == expected
    assert health(hung).num_requests == 1  # it was tried first, and hung
    assert PREFILL_TIMEOUT_S <= time.monotonic() - started < HANG_GUARD_S
    stack.worker_processes[hung].kill()
    publish(stack, [healthy_prefill], [decode])


@BOTH_TRANSPORTS
def test_prefill_killed_mid_transfer_frees_the_decode_blocks(
    stack, client, chat_checkpoint, kv_transport
):
    [healthy_prefill], [decode] = stack.workers["prefill"], stack.workers["decode"]
    stalling = stack.start_worker(
        "prefill",
        str(chat_checkpoint),
        *worker_args(kv_transport),
        env={"TANDEM_FAULTS": "kv_stall_s=600"},
    )
    stack.workers["prefill"].remove(stalling)
    publish(stack, [stalling], [decode])
    total = health(decode).num_blocks
    assert health(decode).num_free_blocks == total
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(ask, client, chat_checkpoint.name)
        wait_until(
            lambda: health(decode).num_free_blocks < total, "the decode worker to reserve blocks"
        )
        stack.worker_processes[stalling].kill()
        wait_until(
            lambda: health(decode).num_free_blocks == total,
            "the decode worker to free the reserved blocks",
        )
        with pytest.raises(
            openai.APIStatusError
        ) as failure:  # the only prefill worker died: a clean 503
            reply.result(timeout=HANG_GUARD_S)
    assert failure.value.status_code == 503 and "prefill" in failure.value.body["message"]
    publish(stack, [healthy_prefill], [decode])
    assert ask(client, chat_checkpoint.name)


@BOTH_TRANSPORTS
def test_decode_killed_mid_stream_ends_the_stream_with_an_error_event(
    stack, client, chat_checkpoint, kv_transport
):
    [prefill], [decode] = stack.workers["prefill"], stack.workers["decode"]
    events = stream_killing_midway(
        stack.openai_address, stack.worker_processes[decode].kill, timeout_s=HANG_GUARD_S
    )
    assert events[-1] != b"[DONE]"
    error = json.loads(events[-1])["error"]
    assert error["code"] == "unavailable" and "decode worker" in error["message"]

    replacement = stack.start_worker("decode", str(chat_checkpoint), *worker_args(kv_transport))
    stack.workers["decode"].remove(replacement)
    publish(stack, [prefill], [replacement])
    assert ask(client, chat_checkpoint.name)
