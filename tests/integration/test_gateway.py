"""Gateway + worker as real processes: a gRPC client calls the public Inference API."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf import json_format

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tandem.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

KV_BYTES = 8 << 20


@pytest.fixture(scope="module")
def stack(services_stack):
    s = services_stack
    yield (
        s.folder,
        inference_pb2_grpc.InferenceStub(s.gateway_channel),
        worker_pb2_grpc.WorkerStub(s.worker_channel),
    )


def chat(content: str, **fields) -> inference_pb2.ChatCompletionRequest:
    return json_format.ParseDict(
        {"messages": [{"role": "user", "content": content}], **fields},
        inference_pb2.ChatCompletionRequest(),
    )


def test_unary_chat_equals_the_engines_greedy_output(stack):
    folder, stub, _ = stack
    tokenizer = Tokenizer(folder)
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "the quick fox"}])
    )
    engine = LLMEngine(EngineConfig(model=folder, kv_cache_bytes=KV_BYTES))
    [expected] = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))

    reply = stub.CreateChatCompletion(
        chat("the quick fox", max_tokens=12, temperature=0), timeout=30
    )
    assert reply.choices[0].message.content.string_value == tokenizer.decode(expected.token_ids)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == len(prompt) + len(expected.token_ids)


def test_stream_joins_to_the_unary_reply_and_ends_with_usage(stack):
    _, stub, _ = stack
    request = chat(
        "the lazy dog", max_tokens=16, temperature=0, stream_options={"include_usage": True}
    )
    unary = stub.CreateChatCompletion(request, timeout=30)
    chunks = list(stub.StreamChatCompletion(request, timeout=30))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content for c in chunks if c.choices)
    assert text == unary.choices[0].message.content.string_value
    assert chunks[-2].choices[0].finish_reason == unary.choices[0].finish_reason
    assert (
        not chunks[-1].choices
        and chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    )


def test_repeated_long_prompt_reports_cached_tokens(stack):
    _, stub, _ = stack
    request = chat("the quick brown fox jumps over the lazy dog " * 6, max_tokens=2)
    first = stub.CreateChatCompletion(request, timeout=30).usage
    second = stub.CreateChatCompletion(request, timeout=30).usage
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == (second.prompt_tokens - 1) // 16 * 16 > 0


def test_completion_and_models(stack):
    folder, stub, _ = stack
    reply = stub.CreateCompletion(
        inference_pb2.CompletionRequest(prompt="the quick", max_tokens=5), timeout=30
    )
    assert (
        reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    )
    [model] = stub.ListModels(inference_pb2.ListModelsRequest(), timeout=5).data
    assert model.id == folder.rstrip("/").split("/")[-1] and model.max_model_len == 512
    assert stub.Health(inference_pb2.HealthCheckRequest(), timeout=5).ready


@pytest.mark.parametrize(
    "request_fields, code, message",
    [
        (dict(model="no-such-model"), grpc.StatusCode.NOT_FOUND, "does not exist"),
        (dict(messages=[]), grpc.StatusCode.INVALID_ARGUMENT, "messages must not be empty"),
        (dict(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1"),
        (dict(max_tokens=100000), grpc.StatusCode.INVALID_ARGUMENT, "exceeds the context"),
        (
            dict(messages=[{"role": "user", "content": "dog " * 600}]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "the context is",
        ),
        (
            dict(messages=[{"role": "wizard", "content": "hi"}]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "role",
        ),
        (dict(temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ],
)
def test_bad_requests_get_a_clear_status_and_the_next_succeeds(
    stack, request_fields, code, message
):
    _, stub, _ = stack
    fields = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **request_fields}
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateChatCompletion(
            json_format.ParseDict(fields, inference_pb2.ChatCompletionRequest()), timeout=30
        )
    assert err.value.code() == code
    assert message in err.value.details()
    assert (
        stub.CreateChatCompletion(chat("hi", max_tokens=2), timeout=30).usage.completion_tokens >= 1
    )


def test_client_that_goes_away_frees_the_workers_blocks(stack):
    _, stub, worker = stack
    aborted_before = worker.Health(worker_pb2.HealthRequest(), timeout=5).num_aborted
    call = stub.StreamChatCompletion(chat("the fox", max_tokens=400, temperature=0), timeout=30)
    next(call), next(call), next(call)
    call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = worker.Health(worker_pb2.HealthRequest(), timeout=5)
        if health.num_free_blocks == health.num_blocks and health.num_running == 0:
            break
        time.sleep(0.05)
    assert health.num_free_blocks == health.num_blocks and health.num_running == 0
    assert health.num_aborted == aborted_before + 1  # freed by the abort, not by finishing
