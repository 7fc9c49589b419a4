"""The worker as a real process over loopback gRPC: outputs, errors, cancellation."""

from __future__ import annotations

import time

import grpc
import pytest

from deploy.processes import start_service, stop
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tandem.v1 import worker_pb2, worker_pb2_grpc

KV_BYTES = 8 << 20


def start_worker(model: str):
    return start_service("services.worker", "--model", model, "--kv-cache-bytes", str(KV_BYTES))


@pytest.fixture(scope="module")
def worker(hf_checkpoint):
    folder = hf_checkpoint("llama")[1]
    proc, address = start_worker(folder)
    channel = grpc.insecure_channel(address)
    yield folder, worker_pb2_grpc.WorkerStub(channel), proc
    channel.close()
    stop(proc)


def generate(stub, prompt, **sampling):
    request = worker_pb2.GenerateRequest(
        prompt_token_ids=prompt, sampling=worker_pb2.SamplingParams(**sampling)
    )
    return list(stub.Generate(request, timeout=30))


def wait_for_free_blocks(stub, timeout_s: float = 10) -> worker_pb2.HealthResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        health = stub.Health(worker_pb2.HealthRequest(), timeout=5)
        if health.num_free_blocks == health.num_blocks or time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def test_streamed_greedy_tokens_equal_the_engines_own(worker):
    folder, stub, _ = worker
    prompts = [[5, 17, 101, 33], list(range(40, 77))]
    engine = LLMEngine(EngineConfig(model=folder, kv_cache_bytes=KV_BYTES))
    expected = engine.generate(
        prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )
    for prompt, want in zip(prompts, expected):
        responses = generate(stub, prompt, max_tokens=20, temperature=0, ignore_eos=True)
        assert [t for r in responses for t in r.token_ids] == want.token_ids
        assert responses[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
        assert all(r.finish_reason == worker_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
        assert responses[-1].num_prompt_tokens == len(prompt)


def test_repeated_prompt_reports_cached_tokens(worker):
    _, stub, _ = worker
    prompt = list(range(100, 150))  # three full blocks, then two tokens
    generate(stub, prompt, max_tokens=2, temperature=0)
    assert generate(stub, prompt, max_tokens=2, temperature=0)[-1].num_cached_tokens == 48


@pytest.mark.parametrize(
    "prompt, sampling, message",
    [
        ([1, 2, 9999], dict(max_tokens=4), "outside the vocabulary"),
        ([1, 2, 3], dict(max_tokens=4, top_p=0), "top_p"),
        ([1, 2, 3], dict(max_tokens=5000), "exceeds the context"),
    ],
)
def test_bad_request_is_invalid_argument_and_the_next_succeeds(worker, prompt, sampling, message):
    _, stub, _ = worker
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, prompt, **sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert (
        len(generate(stub, [1, 2, 3], max_tokens=3, temperature=0, ignore_eos=True)[-1].token_ids)
        == 1
    )


def test_cancelled_stream_aborts_and_frees_its_blocks(worker):
    _, stub, _ = worker
    call = stub.Generate(
        worker_pb2.GenerateRequest(
            prompt_token_ids=list(range(60)),
            sampling=worker_pb2.SamplingParams(max_tokens=400, ignore_eos=True),
        )
    )
    next(call), next(call)
    busy = stub.Health(worker_pb2.HealthRequest())
    assert busy.num_free_blocks < busy.num_blocks and busy.num_running == 1
    call.cancel()
    health = wait_for_free_blocks(stub)
    assert health.num_free_blocks == health.num_blocks
    assert health.num_running == 0
    assert health.num_aborted == busy.num_aborted + 1  # freed by the abort, not by finishing


def test_sigterm_drains_open_streams_refuses_new_ones_and_exits(hf_checkpoint):
    proc, address = start_worker(hf_checkpoint("llama")[1])
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        call = stub.Generate(
            worker_pb2.GenerateRequest(
                prompt_token_ids=[1, 2, 3],
                sampling=worker_pb2.SamplingParams(max_tokens=300, ignore_eos=True),
            ),
            timeout=30,
        )
        received = len(next(call).token_ids)
        proc.terminate()
        # Synchronisation point: the worker reports draining before anything is asserted of it.
        deadline = time.monotonic() + 10
        while not stub.Health(worker_pb2.HealthRequest(), timeout=5).draining:
            assert time.monotonic() < deadline, "the worker never reported draining"
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, [4, 5, 6], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
        responses = list(call)  # the open stream runs to its end
        assert received + sum(len(r.token_ids) for r in responses) == 300
        assert responses[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    assert proc.wait(timeout=10) == 0


def test_streams_past_the_drain_deadline_end_with_unavailable(hf_checkpoint):
    proc, address = start_service(
        "services.worker",
        "--model",
        hf_checkpoint("llama")[1],
        "--kv-cache-bytes",
        str(KV_BYTES),
        "--drain-timeout-s",
        "0",
    )
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        call = stub.Generate(
            worker_pb2.GenerateRequest(
                prompt_token_ids=[1, 2, 3],
                sampling=worker_pb2.SamplingParams(max_tokens=500, ignore_eos=True),
            ),
            timeout=30,
        )
        next(call)
        proc.terminate()
        with pytest.raises(grpc.RpcError) as err:
            for _ in call:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert proc.wait(timeout=10) is not None
