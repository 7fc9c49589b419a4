"""Reasoning out of streamed text, in each family's markup, and through the gateway's
generation: the same reasoning, content and calls however the worker's tokens are grouped
(speculative decoding hands over several at once: one delta can hold the end of the reasoning,
text and the start of a call), token usage counting the reasoning's tokens."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.output.generation import generation_events
from services.gateway.output.reasoning import FORMATS, ReasoningParser, detect, starts_inside
from services.gateway.output.tool_formats import FORMATS as CALL_FORMATS
from services.gateway.protocol import Delta, Finish, GenerationRequest, SamplingOptions, TokenChunk
from tests.unit.gateway.test_tool_calls import splits

CASES = [  # format, starts inside, output, reasoning, content
    (
        "qwen3",
        False,
        "<think>\nThe user wants the weather.\n</think>\n\nIt is sunny.",
        "\nThe user wants the weather.\n",
        "\n\nIt is sunny.",
    ),
    ("qwen3", False, "It is sunny.", "", "It is sunny."),
    ("qwen3", False, "<thinking is fun", "", "<thinking is fun"),
    (
        "deepseek_r1",
        True,
        "Let me think.</think>The answer is 4.",
        "Let me think.",
        "The answer is 4.",
    ),
    ("deepseek_r1", True, "Still thinking when max_tokens", "Still thinking when max_tokens", ""),
    (
        "kimi_k2",
        True,
        "I need the weather.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0",
        "I need the weather.",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0",
    ),
    ("kimi_k2", True, "Done.</think>Sunny.", "Done.", "Sunny."),
]


def run(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    reasoning, content = "", ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("fmt, inside, text, reasoning, content", CASES)
def test_reasoning_is_split_from_the_answer_however_it_streams(
    fmt, inside, text, reasoning, content
):
    for pieces in splits(text):
        parser = ReasoningParser(FORMATS[fmt], inside)
        assert run(parser, pieces) == (reasoning, content), pieces
        assert parser.reasoning == reasoning


def test_the_format_and_where_the_output_starts_are_read_off_the_template_and_prompt():
    assert detect("{{ '<think>' }}<|tool_calls_section_begin|>").name == "kimi_k2"
    assert detect("<｜Assistant｜><think>\n").name == "deepseek_r1"
    assert detect("{%- if enable_thinking %}<think>{% endif %}").name == "qwen3"
    assert detect("<|assistant|>") is None
    assert detect("<think>", name="none") is None and detect("", name="qwen3").name == "qwen3"
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        detect("", name="x")
    fmt = FORMATS["qwen3"]
    assert starts_inside(fmt, "<|im_start|>assistant\n<think>\n")
    # Qwen3, thinking off
    assert not starts_inside(fmt, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_inside(fmt, "<|im_start|>assistant\n")


class ScriptedPool:
    """A worker pool that streams a fixed reply in the given groups of tokens."""

    def __init__(self, groups: list[list[int]]):
        self.groups = groups

    async def generate(self, request, trace_context=None):
        for i, group in enumerate(self.groups):
            yield TokenChunk(group, finish_reason="stop" if i == len(self.groups) - 1 else None)


def collect(tokenizer, prompt: list[int], groups: list[list[int]]):
    request = GenerationRequest("r", prompt, SamplingOptions(max_tokens=100))

    async def run_all():
        return [
            e
            async for e in generation_events(
                ScriptedPool(groups).generate(request),
                tokenizer,
                request,
                0,
                CALL_FORMATS["kimi_k2"],
                0.0,
                FORMATS["kimi_k2"],
            )
        ]

    events = asyncio.run(run_all())
    deltas = [e for e in events if isinstance(e, Delta)]
    finish = next(e for e in events if isinstance(e, Finish))
    return (
        "".join(d.reasoning for d in deltas),
        "".join(d.text for d in deltas),
        [(c.id, c.name, json.loads(c.arguments)) for d in deltas for c in d.tool_calls],
        finish,
    )


def test_a_kimi_turn_gives_the_same_reasoning_and_call_token_by_token_and_in_groups(tmp_path):
    from engine.tokenizer import Tokenizer
    from tests.tiny_models import kimi_tokenizer

    kimi_tokenizer(tmp_path)
    tokenizer = Tokenizer(str(tmp_path))
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "weather in paris?"}])
        + "<think>"
    )
    reply = tokenizer.encode(
        "the user wants the weather.<|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|>"
    )
    expected = None
    for size in (1, 2, 3, 5, len(reply)):  # as plain decoding, and as speculation's accepted runs
        got = collect(tokenizer, prompt, [reply[i : i + size] for i in range(0, len(reply), size)])
        reasoning, content, calls, finish = got
        assert reasoning == "the user wants the weather." and content == ""
        assert calls == [("functions.get_weather:0", "get_weather", {"city": "paris"})]
        assert finish.reason == "tool_calls"
        assert finish.usage.reasoning_tokens == len(tokenizer.encode(reasoning))
        expected = expected or got[:3]
        assert got[:3] == expected


def _events(usage):
    from services.gateway.output.tool_calls import ToolCall
    from services.gateway.output.tool_streams import CallDelta

    call = ToolCall("get_weather", '{"city": "Paris"}', "call_1")

    async def events():  # as generation sends them: each delta with the usage so far
        yield Delta(0, reasoning="need ", usage=usage)
        yield Delta(0, usage=usage)  # text held back (a partial tag or character)
        yield Delta(0, reasoning="weather", text="Checking.", usage=usage)
        yield Delta(
            0,
            call_deltas=[
                CallDelta("start", 0, "call_1", "get_weather"),
                CallDelta("arguments", 0, arguments='{"city": '),
            ],
            usage=usage,
        )
        yield Delta(
            0,
            tool_calls=[call],
            call_deltas=[
                CallDelta("arguments", 0, arguments='"Paris"}'),
                CallDelta("done", 0, call=call),
            ],
            usage=usage,
        )
        yield Finish(0, "tool_calls", usage)

    return events


def _surface(cls, **attrs):
    surface = cls.__new__(cls)
    surface.frontend = type(
        "F", (), {"prices": None, "model": type("M", (), {"name": "m"})(), **attrs}
    )()
    return surface


def test_messages_give_reasoning_as_a_thinking_block_unary_and_streamed():
    from services.gateway.api.messages_api import Messages
    from services.gateway.prepare.requests import Prepared
    from services.gateway.protocol import Usage

    surface, prepared = _surface(Messages), Prepared("msg-1", [None], 1, chat=True)
    events = _events(Usage(prompt_tokens=3, completion_tokens=9, reasoning_tokens=2))

    async def run():
        return await surface.unary(prepared, None, events()), [
            e async for e in surface.chunks(prepared, None, events())
        ]

    unary, streamed = asyncio.run(run())
    assert [b["type"] for b in unary["content"]] == ["thinking", "text", "tool_use"]
    assert unary["content"][0] == {"type": "thinking", "thinking": "need weather", "signature": ""}
    starts = [e["content_block"]["type"] for e in streamed if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    thought = "".join(
        e["delta"]["thinking"]
        for e in streamed
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta"
    )
    assert thought == "need weather"
    stops = [e["index"] for e in streamed if e["type"] == "content_block_stop"]
    assert stops == [0, 1, 2]  # each block closed once, in order


def test_responses_give_reasoning_as_a_reasoning_item_unary_and_streamed():
    from services.gateway.api.response_store import ResponseStore
    from services.gateway.api.responses_api import Responses, ResponsesBody, ResponsesCall
    from services.gateway.prepare.requests import Prepared
    from services.gateway.protocol import Usage

    surface = _surface(Responses)
    surface.store = ResponseStore(10, 60)
    prepared = Prepared("resp-1", [None], 1, chat=True)
    events = _events(Usage(prompt_tokens=3, completion_tokens=9, reasoning_tokens=2))
    call = ResponsesCall(
        ResponsesBody(input="weather?"), [{"role": "user", "content": "weather?"}], "resp_1"
    )

    async def run():
        return await surface.unary(prepared, call, events()), [
            e async for e in surface.chunks(prepared, call, events())
        ]

    unary, streamed = asyncio.run(run())
    assert [item["type"] for item in unary["output"]] == ["reasoning", "message", "function_call"]
    assert unary["output"][0]["content"] == [{"type": "reasoning_text", "text": "need weather"}]
    assert unary["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    deltas = "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta")
    assert deltas == "need weather"
    final = streamed[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    added = [e["item"]["type"] for e in streamed if e["type"] == "response.output_item.added"]
    done = [e["item"]["type"] for e in streamed if e["type"] == "response.output_item.done"]
    assert added == done == ["reasoning", "message", "function_call"]
