"""Prefill and decode workers as separate processes, KV pushed between them over UCX, TCP and
Mooncake's Transfer Engine: the same tokens as the colocated stack and the engine, and cached
tokens stitched into usage."""

from __future__ import annotations

import http.client
import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from google.protobuf import json_format

from deploy.stack import start_stack
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from tandem.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

KV_BYTES = 8 << 20
BLOCK_SIZE = 16
# Mixed lengths: under one block, a few blocks, many blocks.
PROMPTS = [
    "the fox",
    "the quick brown fox " * 3,
    "jumps over the lazy dog " * 12,
    "the lazy dog " * 30,
]


@pytest.fixture(scope="module", params=["ucx", "tcp", "mooncake"])
def disaggregated(request, chat_checkpoint):
    stack = start_stack(
        str(chat_checkpoint),
        topology="disaggregated",
        worker_args=("--kv-cache-bytes", str(KV_BYTES), "--kv-transport", request.param),
        gateway_args=("--request-timeout-s", "30"),
    )
    channel = grpc.insecure_channel(stack.gateway_address)
    yield stack, inference_pb2_grpc.InferenceStub(channel)
    channel.close()
    stack.stop()


def chat(content: str, **fields) -> inference_pb2.ChatCompletionRequest:
    return json_format.ParseDict(
        {"messages": [{"role": "user", "content": content}], **fields},
        inference_pb2.ChatCompletionRequest(),
    )


def concurrent_replies(stub, max_tokens: int = 12) -> list[str]:
    def one(content):
        reply = stub.CreateChatCompletion(
            chat(content, max_tokens=max_tokens, temperature=0), timeout=60
        )
        return reply.choices[0].message.content.string_value

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def test_greedy_outputs_equal_the_colocated_stack_and_the_engine(
    disaggregated, services_stack, chat_checkpoint
):
    stack, stub = disaggregated
    folder = str(chat_checkpoint)
    tokenizer = Tokenizer(folder)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]))
        for p in PROMPTS
    ]
    engine = LLMEngine(EngineConfig(model=folder, kv_cache_bytes=KV_BYTES))
    expected = [
        tokenizer.decode(c.token_ids)
        for c in engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    ]

    disaggregated_replies = concurrent_replies(stub)
    colocated_replies = concurrent_replies(
        inference_pb2_grpc.InferenceStub(services_stack.gateway_channel)
    )
    assert disaggregated_replies == expected
    assert colocated_replies == expected
    decode = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(stack.workers["decode"][0]))
    health = decode.Health(worker_pb2.HealthRequest(), timeout=5)
    assert health.num_requests >= len(PROMPTS) and health.role == "decode"


def test_second_long_request_reports_its_cached_blocks_streamed_and_unary(
    disaggregated, chat_checkpoint
):
    stack, stub = disaggregated
    content = "the quick brown fox jumps over the lazy dog, twice " * 5
    first = stub.CreateChatCompletion(chat(content, max_tokens=3), timeout=30).usage
    unary = stub.CreateChatCompletion(chat(content, max_tokens=3), timeout=30).usage
    streamed = list(
        stub.StreamChatCompletion(
            chat(content, max_tokens=3, stream_options={"include_usage": True}), timeout=30
        )
    )[-1].usage
    full_blocks = (first.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert first.prompt_tokens_details.cached_tokens == 0
    assert full_blocks > 0
    assert unary.prompt_tokens_details.cached_tokens == full_blocks
    assert streamed.prompt_tokens_details.cached_tokens == full_blocks

    # The OpenAI SDK through Envoy, unary and streamed, sees the same figure.
    client = openai.OpenAI(
        base_url=f"http://{stack.envoy_address}/v1", api_key="none", max_retries=0
    )
    messages = [{"role": "user", "content": content}]
    reply = client.chat.completions.create(
        model=chat_checkpoint.name, messages=messages, max_tokens=3
    )
    chunks = list(
        client.chat.completions.create(
            model=chat_checkpoint.name,
            messages=messages,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert reply.usage.prompt_tokens_details.cached_tokens == full_blocks
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full_blocks


def test_rest_transcoded_stream_carries_cached_tokens(disaggregated):
    stack, _ = disaggregated
    host, port = stack.envoy_address.split(":")
    body = {
        "messages": [{"role": "user", "content": "over the lazy dog and back again " * 5}],
        "max_tokens": 2,
        "stream_options": {"include_usage": True},
    }
    usages = []
    for _ in range(2):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request(
            "POST",
            "/tandem/v1/chat/completions:stream",
            body=json.dumps(body),
            headers={"Content-Type": "application/json"},
        )
        events = [
            json.loads(line[6:])
            for line in conn.getresponse().read().splitlines()
            if line.startswith(b"data: ")
        ]
        usages.append(events[-1]["usage"])
    assert (
        usages[1]["prompt_tokens_details"]["cached_tokens"]
        == (usages[1]["prompt_tokens"] - 1) // 16 * 16
        > 0
    )


def test_decode_without_landed_kv_fails_at_its_deadline_not_never(disaggregated):
    stack, _ = disaggregated
    with grpc.insecure_channel(stack.workers["decode"][0]) as channel:
        decode = worker_pb2_grpc.DecodeStub(channel)
        request = worker_pb2.DecodeRequest(
            request_id="never-prefilled",
            prompt_token_ids=[5, 6, 7],
            sampling=worker_pb2.SamplingParams(max_tokens=4),
            kv_wait_timeout_s=0.3,
        )
        with pytest.raises(grpc.RpcError) as failure:
            list(decode.Decode(request, timeout=30))
    assert failure.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not land" in failure.value.details()


def test_each_role_refuses_the_others_calls(disaggregated):
    stack, _ = disaggregated
    with grpc.insecure_channel(stack.workers["prefill"][0]) as channel:
        with pytest.raises(grpc.RpcError) as failure:
            list(
                worker_pb2_grpc.WorkerStub(channel).Generate(
                    worker_pb2.GenerateRequest(prompt_token_ids=[1]), timeout=10
                )
            )
    assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with grpc.insecure_channel(stack.workers["decode"][0]) as channel:
        with pytest.raises(grpc.RpcError) as failure:
            worker_pb2_grpc.PrefillStub(channel).Prefill(
                worker_pb2.PrefillRequest(prompt_token_ids=[1]), timeout=10
            )
    assert failure.value.code() == grpc.StatusCode.UNIMPLEMENTED
