"""GenerateMany, many requests over one call, as the gateway runs them (services/worker/
generate_many.py, services/gateway/shared_call.py): each request's outputs are Generate's, a
step's outputs travel together, and a request that fails, is cancelled, or is left on a call
that ends holds nothing."""

from __future__ import annotations

import os
import queue
import signal
import time

import grpc
import openai
import pytest

from deploy.processes import start_service, stop
from deploy.stack import start_stack
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tests.integration.test_worker import KV_BYTES, generate, wait_for_free_blocks

STATUS = {code.value[0]: code for code in grpc.StatusCode}


@pytest.fixture(scope="module")
def worker(hf_checkpoint):
    proc, address = start_service(
        "services.worker", "--model", hf_checkpoint("llama")[1], "--kv-cache-bytes", str(KV_BYTES)
    )
    channel = grpc.insecure_channel(address)
    yield worker_pb2_grpc.WorkerStub(channel)
    channel.close()
    stop(proc)


class Call:
    """A GenerateMany call fed from a queue, so a test can add and cancel as it goes."""

    def __init__(self, stub):
        self.outbox: queue.Queue = queue.Queue()
        self.call = stub.GenerateMany(iter(self.outbox.get, None), timeout=60)

    def add(self, request_id: str, prompt: list[int], **sampling) -> None:
        self.outbox.put(
            worker_pb2.GenerateManyRequest(
                add=worker_pb2.GenerateRequest(
                    request_id=request_id,
                    prompt_token_ids=prompt,
                    sampling=worker_pb2.SamplingParams(**sampling),
                )
            )
        )

    def cancel(self, request_id: str) -> None:
        self.outbox.put(worker_pb2.GenerateManyRequest(cancel=request_id))

    def close(self) -> None:
        self.outbox.put(None)


def test_many_requests_on_one_call_get_generates_tokens_a_step_together(worker):
    prompts = {f"r{i}": [3 + i, 17, 101, 33 + i] * (i + 1) for i in range(4)}
    call = Call(worker)
    # long enough that the four overlap even when the worker's loop admits them a while apart
    for request_id, prompt in prompts.items():
        call.add(request_id, prompt, max_tokens=48, temperature=0, ignore_eos=True)
    call.close()
    tokens = {request_id: [] for request_id in prompts}
    finished, shared_batches = set(), 0
    for batch in call.call:
        shared_batches += len({item.request_id for item in batch.items}) > 1
        for item in batch.items:
            assert not item.error_code, item.error_message
            tokens[item.request_id] += item.response.token_ids
            if item.response.finish_reason:
                finished.add(item.request_id)
    assert finished == set(prompts)
    for request_id, prompt in prompts.items():  # each request's tokens as Generate gives them
        alone = generate(worker, prompt, max_tokens=48, temperature=0, ignore_eos=True)
        assert tokens[request_id] == [t for r in alone for t in r.token_ids]
    assert shared_batches > 0  # the point: requests of one step share a message


def test_a_bad_request_fails_alone_and_a_cancelled_one_is_aborted(worker):
    before = worker.Health(worker_pb2.HealthRequest(), timeout=5)
    call = Call(worker)
    call.add("bad", [1, 2, 9999], max_tokens=4)
    call.add("long", list(range(60)), max_tokens=400, ignore_eos=True)
    call.add("good", [1, 2, 3], max_tokens=5, temperature=0, ignore_eos=True)
    errors, good_tokens, long_items = {}, 0, 0
    for batch in call.call:
        for item in batch.items:
            if item.error_code:
                errors[item.request_id] = (STATUS[item.error_code], item.error_message)
            elif item.request_id == "good":
                good_tokens += len(item.response.token_ids)
            elif item.request_id == "long":
                long_items += 1
                assert not item.response.finish_reason
                if long_items == 2:
                    call.cancel("long")
                    call.close()
    code, message = errors.pop("bad")
    assert not errors and code == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in message
    assert good_tokens == 5
    health = wait_for_free_blocks(worker)
    assert health.num_free_blocks == health.num_blocks and health.num_running == 0
    assert health.num_aborted == before.num_aborted + 1  # the cancelled one, not the bad one


def test_ending_the_call_aborts_every_request_still_on_it(worker):
    before = worker.Health(worker_pb2.HealthRequest(), timeout=5)
    call = Call(worker)
    for i in range(3):
        call.add(f"r{i}", list(range(10 * i, 10 * i + 40)), max_tokens=400, ignore_eos=True)
    seen = set()
    for batch in call.call:
        seen |= {item.request_id for item in batch.items}
        if len(seen) == 3:
            break
    call.call.cancel()
    health = wait_for_free_blocks(worker)
    assert health.num_free_blocks == health.num_blocks and health.num_running == 0
    assert health.num_aborted == before.num_aborted + 3


def test_a_hung_worker_costs_a_request_its_deadline_and_the_call_recovers(chat_checkpoint):
    stack = start_stack(
        str(chat_checkpoint),
        worker_args=("--kv-cache-bytes", str(KV_BYTES)),
        gateway_args=("--request-timeout-s", "3"),
    )
    worker_process = stack.processes[0]
    client = openai.OpenAI(
        base_url=f"http://{stack.openai_address}/v1", api_key="none", max_retries=0, timeout=30
    )
    ask = dict(model=chat_checkpoint.name, messages=[{"role": "user", "content": "hi"}])
    try:
        client.chat.completions.create(max_tokens=2, **ask)  # the shared call is open
        os.kill(worker_process.pid, signal.SIGSTOP)
        try:  # a hang would end in the client's 30 s timeout (APITimeoutError)
            client.chat.completions.create(max_tokens=2, **ask)
            raise AssertionError("expected an error")
        except openai.APIStatusError as exc:
            assert exc.status_code == 504
        os.kill(worker_process.pid, signal.SIGCONT)
        for _ in range(100):  # until the gateway's health poll sees the worker again
            try:
                reply = client.chat.completions.create(max_tokens=2, **ask)
                break
            except openai.APIStatusError as exc:
                assert exc.status_code == 503
                time.sleep(0.1)
        assert reply.choices[0].finish_reason in ("stop", "length")
        with grpc.insecure_channel(stack.worker_addresses[0]) as channel:
            health = wait_for_free_blocks(worker_pb2_grpc.WorkerStub(channel))
        assert health.num_free_blocks == health.num_blocks  # nothing is left held
    finally:
        os.kill(worker_process.pid, signal.SIGCONT)
        stack.stop()
