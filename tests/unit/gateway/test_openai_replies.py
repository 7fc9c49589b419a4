"""One builder for OpenAI's replies (services/gateway/api/openai_replies.py): the gRPC surface
sends what the HTTP surface sends, field for field, unary and streamed."""

from __future__ import annotations

import asyncio

from google.protobuf import json_format

from services.gateway.api import openai_replies
from services.gateway.api.grpc_api import message_from
from services.gateway.output.tool_calls import ToolCall
from services.gateway.output.tool_streams import ARGUMENTS, DONE, START, CallDelta
from services.gateway.prepare.requests import Prepared
from services.gateway.pricing import Prices
from services.gateway.protocol import (
    Delta,
    Finish,
    GenerationRequest,
    SamplingOptions,
    TokenLogprob,
    Usage,
)
from tandem.v1 import inference_pb2

PRICES = Prices.parse("input:0.60,cached_input:0.10,output:3.00")


def events(num_choices: int):
    """Two choices' events, interleaved as the frontend merges them."""
    out = []
    for i in range(num_choices):
        usage = Usage(
            prompt_tokens=12,
            completion_tokens=4,
            cached_tokens=8 - i,
            store_tokens={"dram": 2, "disk": 0},
        )
        call = ToolCall("get_weather", '{"city": "Paris"}', id=f"call_{i}")
        out.append(
            [
                Delta(i, reasoning="hmm", usage=usage),
                Delta(
                    i,
                    text="Sunny",
                    logprobs=[TokenLogprob("Sun", -0.25, [("Sun", -0.25), ("Rain", -2.0)])],
                    usage=usage,
                ),
                Delta(
                    i,
                    call_deltas=[
                        CallDelta(START, 0, f"call_{i}", "get_weather", '{"city"'),
                        CallDelta(ARGUMENTS, 0, arguments=': "Paris"}'),
                    ],
                    usage=usage,
                ),
                Delta(
                    i, call_deltas=[CallDelta(DONE, 0, call=call)], tool_calls=[call], usage=usage
                ),
                Finish(i, "tool_calls", usage),
            ]
        )
    return [choice[k] for k in range(5) for choice in out]


def prepared(num_choices: int, kind: str = "chatcmpl") -> Prepared:
    generation = GenerationRequest("g", [1, 2, 3], SamplingOptions(max_tokens=4, logprobs=True))
    return Prepared(f"{kind}-1", [generation] * num_choices, num_choices)


async def _stream(items):
    for item in items:
        yield item


def as_json(message) -> dict:
    data = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return {**data, "created": int(data["created"])}  # an int64, which protobuf's JSON quotes


def without_extras(value):
    """OpenAI's JSON as protobuf's JSON prints it: nulls, empty values and the `reasoning` alias
    left out (the proto has reasoning_content only), floats as float32."""
    if isinstance(value, dict):
        kept = {k: without_extras(v) for k, v in value.items() if k != "reasoning"}
        return {k: v for k, v in kept.items() if v not in (None, "", 0, [], False) or k == "delta"}
    if isinstance(value, list):
        return [without_extras(v) for v in value]
    return value


def test_grpc_chunks_carry_what_http_chunks_carry_with_each_role_at_its_first_event():
    chunks = asyncio.run(
        _collect(openai_replies.chat_chunks(prepared(2), "m", PRICES, _stream(events(2)), True))
    )
    roles = [
        c["choices"][0]["index"]
        for c in chunks
        if c["choices"] and c["choices"][0]["delta"].get("role")
    ]
    # choice 0's reasoning before choice 1's role
    assert roles == [0, 1] and chunks[1]["choices"][0]["index"] == 0
    for chunk in chunks:
        encoded = message_from(chunk, inference_pb2.ChatCompletionChunk())
        assert as_json(encoded) == without_extras(chunk)
    finish = message_from(chunks[-2], inference_pb2.ChatCompletionChunk())
    assert finish.choices[0].HasField("delta") and finish.choices[0].finish_reason == "tool_calls"
    usage = message_from(chunks[-1], inference_pb2.ChatCompletionChunk()).usage
    # n=2 choices of one prompt: the prompt counted once, with the fewer cached tokens of the two
    assert (
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
        usage.completion_tokens,
    ) == (12, 7, 8)
    assert usage.cost > 0


def test_grpc_unary_replies_carry_what_http_replies_carry():
    chat = asyncio.run(openai_replies.chat_completion(prepared(2), "m", PRICES, _stream(events(2))))
    assert chat["choices"][1]["message"]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"] == {
        "local": 5,
        "store_dram": 2,
        "store_disk": 0,
        "mooncake_dram": 0,
        "mooncake_disk": 0,
    }
    message = message_from(chat, inference_pb2.ChatCompletion())
    assert message.choices[0].message.content.string_value == "Sunny"
    # content: a Value, whose JSON is the string itself
    assert as_json(message) == without_extras(chat)

    text = asyncio.run(
        openai_replies.completion(prepared(1, "cmpl"), "m", None, _stream(events(1)))
    )
    # HTTP only: the proto has no completion logprobs
    assert text["choices"][0]["logprobs"]["tokens"] == ["Sun"]
    assert as_json(message_from(text, inference_pb2.Completion())) == without_extras(
        {**text, "choices": [{**c, "logprobs": None} for c in text["choices"]]}
    )


async def _collect(chunks):
    return [c async for c in chunks]


def test_every_step_of_tokens_is_a_chunk_even_when_its_text_is_held_back():
    """A step whose text is held back (a stop string forming, a character's first bytes, a
    special token) still streams a chunk, as vLLM's do: a client times each token by them."""
    usage = Usage(prompt_tokens=3, completion_tokens=2)
    steps = [Delta(0, text="", usage=usage), Delta(0, text="Hi", usage=usage)]
    finish = Finish(0, "length", usage)
    completion = asyncio.run(
        _collect(
            openai_replies.completion_chunks(
                prepared(1, "cmpl"), "m", None, _stream([*steps, finish]), False
            )
        )
    )
    assert [c["choices"][0]["text"] for c in completion] == ["", "Hi", ""]
    chat = asyncio.run(
        _collect(
            openai_replies.chat_chunks(prepared(1), "m", None, _stream([*steps, finish]), False)
        )
    )
    assert [c["choices"][0]["delta"] for c in chat] == [
        {"role": "assistant", "content": ""},
        {"content": ""},
        {"content": "Hi"},
        {},
    ]
