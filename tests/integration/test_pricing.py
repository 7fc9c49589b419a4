"""Priced usage: with --prices, every usage carries cost and cost_details by the formula,
unary and streamed, OpenAI HTTP and gRPC, colocated and disaggregated."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest

from deploy.stack import start_stack
from tandem.v1 import inference_pb2, inference_pb2_grpc

PRICES = {"input": 0.60, "cached_input": 0.10, "output": 3.00}
# several full blocks, cached on repeat
CONTENT = "the quick brown fox jumps over the lazy dog " * 12


def expected(usage: dict) -> tuple[float, dict]:
    prompt, cached, completion = (
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["completion_tokens"],
    )
    cost = (
        (prompt - cached) * PRICES["input"]
        + cached * PRICES["cached_input"]
        + completion * PRICES["output"]
    ) / 1e6
    details = {
        "input": (prompt - cached) * PRICES["input"] / 1e6,
        "cached_input": cached * PRICES["cached_input"] / 1e6,
        "output": completion * PRICES["output"] / 1e6,
    }
    return cost, details


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def stack(request, chat_checkpoint):
    prices = ",".join(f"{k}:{v}" for k, v in PRICES.items())
    local = start_stack(
        str(chat_checkpoint),
        topology=request.param,
        worker_args=("--kv-cache-bytes", str(8 << 20)),
        gateway_args=("--prices", prices),
    )
    yield local
    local.stop()


def openai_usage(address: str, stream: bool) -> dict:
    body = {
        "messages": [{"role": "user", "content": CONTENT}],
        "max_tokens": 4,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }
    request = urllib.request.Request(
        f"http://{address}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        if not stream:
            return json.load(response)["usage"]
        events = [json.loads(line[6:]) for line in response if line.startswith(b"data: {")]
    return events[-1]["usage"]


def test_openai_usage_is_priced_unary_and_streamed(stack):
    for stream in (False, True, False):
        usage = openai_usage(stack.envoy_address, stream)
        cost, details = expected(usage)
        assert usage["cost"] == cost and usage["cost_details"] == details
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the repeat hit the prefix cache


def test_grpc_usage_is_priced_unary_and_streamed(stack):
    request = inference_pb2.ChatCompletionRequest(
        max_tokens=4, stream_options=inference_pb2.StreamOptions(include_usage=True)
    )
    message = request.messages.add(role="user")
    message.content.string_value = CONTENT
    with grpc.insecure_channel(stack.envoy_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        usages = [
            stub.CreateChatCompletion(request, timeout=30).usage,
            list(stub.StreamChatCompletion(request, timeout=30))[-1].usage,
        ]
    for usage in usages:
        as_dict = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
        }
        cost, details = expected(as_dict)
        assert usage.HasField("cost") and usage.cost == cost
        assert (
            usage.cost_details.input,
            usage.cost_details.cached_input,
            usage.cost_details.output,
        ) == (details["input"], details["cached_input"], details["output"])
        assert usage.prompt_tokens_details.cached_tokens > 0


def test_without_prices_usage_has_no_cost(services_stack):
    usage = openai_usage(services_stack.openai_address, stream=False)
    assert "cost" not in usage and "cost_details" not in usage
