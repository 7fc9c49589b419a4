"""Tensor-parallel workers through the whole stack: two colocated workers of two ranks each
answer as a one-rank worker does; a mixture of experts with its experts spread over two ranks
answers through the stack with the engine's own greedy tokens; killing one worker's rank
mid-stream ends that stream with a clear error within the deadline, the worker then reports
itself leaving and refuses work, and the gateway serves on with the other worker."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

import grpc
import psutil
import pytest

from demo.upcycle import upcycle
from deploy.stack import start_stack
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tandem.v1 import worker_pb2, worker_pb2_grpc

PROMPT = [(i * 7) % 370 + 3 for i in range(40)]


def complete(address: str, max_tokens: int = 12) -> dict:
    request = urllib.request.Request(
        f"http://{address}/v1/completions",
        headers={"Content-Type": "application/json"},
        data=json.dumps(
            {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        ).encode(),
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def rank_processes(worker) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(worker.pid).children()
        if "resource_tracker" not in " ".join(p.cmdline())
    ]


@pytest.fixture(scope="module")
def tp_stack(chat_checkpoint):
    stack = start_stack(
        str(chat_checkpoint),
        num_workers=2,
        worker_args=("--kv-cache-bytes", str(8 << 20), "--tensor-parallel-size", "2"),
    )
    yield stack
    stack.stop()


def test_two_rank_workers_answer_as_one_rank_does(tp_stack, services_stack):
    assert all(len(rank_processes(p)) == 1 for p in tp_stack.worker_processes.values())
    got = complete(tp_stack.envoy_address)["choices"][0]["text"]
    assert got == complete(services_stack.processes.openai_address)["choices"][0]["text"]


def test_a_mixture_of_experts_on_two_expert_parallel_ranks_serves_the_engine_s_tokens(
    hf_checkpoint, chat_checkpoint, tmp_path
):
    folder = tmp_path / "moe-chat"
    shutil.copytree(hf_checkpoint("qwen3_moe")[1], folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chat_checkpoint / name, folder / name)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", kv_cache_bytes=8 << 20))
    [want] = engine.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    stack = start_stack(
        str(folder),
        worker_args=(
            "--kv-cache-bytes",
            str(8 << 20),
            "--tensor-parallel-size",
            "2",
            "--enable-expert-parallel",
        ),
    )
    try:
        got = complete(stack.envoy_address)["choices"][0]["text"]
    finally:
        stack.stop()
    assert got == engine.tokenizer.decode(want.token_ids)


@pytest.mark.parametrize("topology", ["colocated", "disaggregated"])
def test_the_demo_mixture_of_experts_on_two_ranks_serves_the_engine_s_tokens(tmp_path, topology):
    """`make demo-moe` then `make run MODEL=build/tandem-demo-moe TP=2 [TOPOLOGY=disaggregated]`:
    prefill and decode workers of two ranks each move the KV in one engine's layout."""
    folder = upcycle(str(tmp_path / "demo-moe"))
    engine = LLMEngine(EngineConfig(model=folder, kv_cache_bytes=8 << 20))
    chat = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(chat["messages"]))
    [want] = engine.generate([prompt], SamplingParams(max_tokens=16, temperature=0))
    stack = start_stack(
        folder,
        topology=topology,
        worker_args=("--kv-cache-bytes", str(8 << 20), "--tensor-parallel-size", "2"),
    )
    try:
        request = urllib.request.Request(
            f"http://{stack.envoy_address}/v1/chat/completions",
            headers={"Content-Type": "application/json"},
            data=json.dumps(chat).encode(),
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            got = json.load(response)["choices"][0]["message"]["content"]
    finally:
        stack.stop()
    assert got == engine.tokenizer.decode(want.token_ids) == "The capital of France is Paris."


def test_a_dead_rank_fails_its_stream_and_the_gateway_serves_on(tp_stack):
    address = tp_stack.worker_addresses[0]
    [rank] = rank_processes(tp_stack.worker_processes[address])
    request = worker_pb2.GenerateRequest(
        prompt_token_ids=PROMPT,
        sampling=worker_pb2.SamplingParams(max_tokens=460, temperature=0, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        stream = stub.Generate(request, timeout=120)
        next(stream)  # generating
        rank.kill()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            for _ in stream:
                pass
        assert time.monotonic() - started < 30
        assert "rank" in caught.value.details()
        deadline = time.monotonic() + 10
        while not stub.Health(worker_pb2.HealthRequest(), timeout=5).draining:
            assert time.monotonic() < deadline, "the worker never reported itself leaving"
            time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Generate(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    time.sleep(1.5)  # the gateway's next Health poll
    for _ in range(4):  # every request now goes to the other worker
        assert complete(tp_stack.envoy_address)["choices"][0]["finish_reason"] == "length"
