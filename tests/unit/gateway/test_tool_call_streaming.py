"""Tool calls stream: announced once their name is written, their arguments in deltas that are
always a valid JSON prefix and join to exactly the finished call's arguments, at every split
of each family's transcript (speculative decoding hands the parser many tokens at once);
a call whose JSON breaks off is abandoned and its span comes back as text, with finish_reason
"stop", in the chat, Responses and Messages streams alike."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from services.gateway.output.json_prefix import JsonPrefix
from services.gateway.output.tool_calls import ToolCallParser
from services.gateway.output.tool_formats import FORMATS
from services.gateway.output.tool_streams import ARGUMENTS, DONE, START, CallDelta
from services.gateway.protocol import Finish, Usage
from tests.unit.gateway.test_tool_calls import TRANSCRIPTS, splits


def stream(fmt: str, pieces: list[str]) -> tuple[list[list], list]:
    """The parts each piece gave (the last list: the end of the stream's)."""
    parser = ToolCallParser(FORMATS[fmt])
    return [parser.read(p) for p in pieces] + [parser.read_end()]


def check_steps(parts: list) -> tuple[str, list, dict[int, str]]:
    """Content, finished calls, and each call's joined arguments, asserting the steps' order:
    a call's start first, then its arguments, then exactly one done or abandoned; every
    joined prefix of a call's arguments JSON whose every token is whole."""
    content, calls, joined, ended = "", [], {}, set()
    for part in parts:
        if isinstance(part, str):
            content += part
            continue
        assert part.index not in ended, part
        if part.kind == START:
            assert part.index not in joined and part.id and part.name
            joined[part.index] = part.arguments
        else:
            assert part.index in joined, f"{part.kind} before the call's start"
            if part.kind == ARGUMENTS:
                joined[part.index] += part.arguments
            else:
                ended.add(part.index)
                if part.kind == DONE:
                    assert part.call.arguments == joined[part.index] and part.call.id
                    calls.append(part.call)
        # a space after it ends a number, and breaks an unfinished literal or escape
        prefix = JsonPrefix()
        prefix.feed(joined[part.index] + " ")
        assert not prefix.failed and prefix.decided >= len(joined[part.index]), joined[part.index]
    assert ended == set(joined), "a call left neither done nor abandoned"
    return content, calls, joined


@pytest.mark.parametrize("fmt, text, content, calls", TRANSCRIPTS, ids=[t[0] for t in TRANSCRIPTS])
def test_deltas_join_to_the_finished_arguments_at_every_split(fmt, text, content, calls):
    expected = None
    for pieces in splits(text):
        got_content, got_calls, joined = check_steps([p for ps in stream(fmt, pieces) for p in ps])
        assert got_content == content, pieces
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, pieces
        assert sorted(joined) == list(range(len(calls))), pieces  # each call its own index
        expected = expected or [(c.name, c.arguments) for c in got_calls]
        # the same text, however cut
        assert [(c.name, c.arguments) for c in got_calls] == expected, pieces


@pytest.mark.parametrize(
    "fmt, text, content, calls",
    [t for t in TRANSCRIPTS if t[3] and t[0] != "qwen3_coder"],
    ids=[t[0] for t in TRANSCRIPTS if t[3] and t[0] != "qwen3_coder"],
)
def test_json_arguments_stream_while_the_call_is_being_written(fmt, text, content, calls):
    """Fed a character at a time, each call is announced and its arguments arrive in several
    deltas before its span closes."""
    per_piece = stream(fmt, list(text))
    started = [
        i
        for i, parts in enumerate(per_piece)
        for p in parts
        if isinstance(p, CallDelta) and p.kind == START
    ]
    done = [
        i
        for i, parts in enumerate(per_piece)
        for p in parts
        if isinstance(p, CallDelta) and p.kind == DONE
    ]
    pieces = [
        i
        for i, parts in enumerate(per_piece)
        for p in parts
        if isinstance(p, CallDelta) and p.kind == ARGUMENTS and p.index == 0
    ]
    assert len(started) == len(calls) and all(s < d for s, d in zip(started, done))
    assert len(pieces) > 3 and pieces[0] < done[0]
    assert [json.loads(c) for c in [check_steps([p for ps in per_piece for p in ps])[2][0]]] == [
        calls[0][1]
    ]


def test_arguments_are_the_model_s_own_json_text():
    text = '<tool_call>{"name": "f", "arguments": {"b":2,  "a": [1.50, "\\u00e9"]}}</tool_call>'
    _, calls, _ = check_steps([p for ps in stream("hermes", [text]) for p in ps])
    assert calls[0].arguments == '{"b":2,  "a": [1.50, "\\u00e9"]}'


def test_undecided_tokens_wait_until_they_are_decided():
    parser = ToolCallParser(FORMATS["hermes"])
    steps = parser.read('<tool_call>{"name": "f", "arguments": {"n": 12')
    assert [(s.kind, s.arguments) for s in steps] == [(START, ""), (ARGUMENTS, '{"n": ')]
    assert parser.read("3") == []  # 123 may go on
    # the escape is unfinished
    assert [s.arguments for s in parser.read(', "s": "a\\u00')] == ['123, "s": "a']
    assert [s.arguments for s in parser.read('e9", "t": tr')] == ['\\u00e9", "t": ']
    assert [s.arguments for s in parser.read("ue}")] == ["true}"]


MALFORMED = [  # format, output, the arguments streamed before the JSON broke off
    (
        "hermes",
        'Hm. <tool_call>{"name": "f", "arguments": {"a": 1, "b": tru}}</tool_call> ok',
        '{"a": 1, "b": ',
    ),
    (
        "hermes",
        '<tool_call>{"name": "f", "arguments": {"a": "x"}</tool_call>',
        '{"a": "x"}',
    ),  # outer } missing
    (
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
        '{"a": 1}<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{"b": NaN}'
        "<|tool_call_end|><|tool_calls_section_end|>",
        '{"b": ',
    ),
    (
        "deepseek_v31",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": [1, 2}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>",
        '{"a": [1, 2',
    ),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": "unterminated', '{"a": "unterminated'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} trailing words', '{"a": 1}'),
]


@pytest.mark.parametrize("fmt, text, last_prefix", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_call_whose_json_breaks_off_is_abandoned_and_its_span_is_text(fmt, text, last_prefix):
    """Policy: its deltas stop at the last valid prefix, it is abandoned (never done), and the
    whole span follows as content, exactly the content the unary reply has; no call finishes."""
    for pieces in splits(text):
        parts = [p for ps in stream(fmt, pieces) for p in ps]
        content, calls, joined = check_steps(parts)
        assert calls == [] and content == text, pieces
        assert joined[max(joined)] == last_prefix, pieces
        assert all(p.kind != DONE for p in parts if isinstance(p, CallDelta))


def test_the_prefix_check_agrees_with_json_loads():
    rng = random.Random(0)
    values = [
        {"a": [1, -2.5e3, True, None, 'x\\"\n\u00e9'], "b": {}},
        {"k": 0},
        {},
        {"nested": [[{"x": []}]]},
    ]
    for value in values:
        text = json.dumps(value, indent=rng.choice([None, 2]), ensure_ascii=rng.random() < 0.5)
        for cut in range(len(text) + 1):
            prefix = JsonPrefix()
            prefix.feed(text[:cut])
            prefix.feed(text[cut:] + " tail")
            assert not prefix.failed and prefix.end == len(text)
    for bad in (
        '{"a": NaN}',
        '{"a": 01}',
        '{"a": "\x01"}',
        '{"a" 1}',
        '{"a": 1,}',
        '{"a": [1}',
        '{"a": tru}',
        '{"a": "\\x"}',
        '{"a": 1.}',
        '{"a": -}',
    ):
        prefix = JsonPrefix()
        prefix.feed(bad)
        assert prefix.failed, bad
    alphabet = '{}[]":,0123456789.-eE+ tfrueanl\\u'
    for _ in range(5000):
        text = "{" + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        prefix = JsonPrefix()
        prefix.feed(text)
        if prefix.end is not None:
            json.loads(text[: prefix.end])


# The three streaming APIs, over what generation sends (its _Channels), one piece at a time.


def _events(fmt: str, pieces: list[str]):
    from services.gateway.output.generation import _Channels

    async def events():
        parser = ToolCallParser(FORMATS[fmt])
        channels = _Channels(None, parser)
        usage = Usage(prompt_tokens=3, completion_tokens=len(pieces))
        for i, piece in enumerate(pieces):
            for delta in channels.deltas(0, piece, i == len(pieces) - 1):
                delta.usage = usage
                yield delta
        yield Finish(0, "tool_calls" if parser.tool_calls else "stop", usage)

    return events


def _surface(cls):
    surface = cls.__new__(cls)
    surface.frontend = type("F", (), {"prices": None, "model": type("M", (), {"name": "m"})()})()
    return surface


def _run(surface, prepared, parsed, events):
    async def run():
        return await surface.unary(prepared, parsed, events()), [
            e async for e in surface.chunks(prepared, parsed, events())
        ]

    return asyncio.run(run())


TWO_CALLS = (
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
)


def _pieces(text: str) -> list[str]:
    """Cuts of 1 to 9 characters: some hold the end of one call and the start of the next."""
    rng, pieces, at = random.Random(3), [], 0
    while at < len(text):
        size = rng.randint(1, 9)
        pieces.append(text[at : at + size])
        at += size
    return pieces


@pytest.mark.parametrize("text, reason", [(TWO_CALLS, "tool_calls"), (MALFORMED[0][1], "stop")])
def test_chat_completions_stream_arguments_as_openai_does(text, reason):
    from services.gateway.api.openai_api import ChatCompletions
    from services.gateway.api.openai_models import ChatCompletionBody
    from services.gateway.prepare.requests import Prepared

    body = ChatCompletionBody(messages=[{"role": "user", "content": "hi"}], stream=True)
    unary, chunks = _run(
        _surface(ChatCompletions),
        Prepared("chatcmpl-1", [None], 1, chat=True),
        body,
        _events("hermes", _pieces(text)),
    )
    message, calls = unary["choices"][0]["message"], {}
    for chunk in chunks:
        for entry in chunk["choices"][0]["delta"].get("tool_calls", []):
            if "id" in entry:  # the announcement: id, type and name, before any arguments
                assert entry["index"] not in calls and entry["function"]["name"]
                calls[entry["index"]] = {
                    "id": entry["id"],
                    "name": entry["function"]["name"],
                    "arguments": "",
                }
            calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
    assert (
        chunks[-1]["choices"][0]["finish_reason"] == unary["choices"][0]["finish_reason"] == reason
    )
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == message["content"]
    if reason == "tool_calls":
        assert [
            {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message["tool_calls"]
        ] != []
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
        ]
        # in pieces
        assert sum(len(c["choices"][0]["delta"].get("tool_calls", [])) for c in chunks) > 4
    else:
        assert "tool_calls" not in message and content == text
        assert calls[0]["arguments"] == MALFORMED[0][2]


@pytest.mark.parametrize("text", [TWO_CALLS, MALFORMED[0][1]])
def test_responses_stream_function_call_arguments_deltas(text):
    from services.gateway.api.response_store import ResponseStore
    from services.gateway.api.responses_api import Responses, ResponsesBody, ResponsesCall
    from services.gateway.prepare.requests import Prepared

    surface = _surface(Responses)
    surface.store = ResponseStore(10, 60)
    call = ResponsesCall(
        ResponsesBody(input="weather?"), [{"role": "user", "content": "weather?"}], "resp_1"
    )
    unary, streamed = _run(
        surface, Prepared("resp-1", [None], 1, chat=True), call, _events("hermes", _pieces(text))
    )
    added = {
        e["output_index"]: e["item"] for e in streamed if e["type"] == "response.output_item.added"
    }
    assert sorted(added) == list(range(len(added)))  # output_index counts the items as they open
    joined = {}
    for e in streamed:
        if e["type"] == "response.function_call_arguments.delta":
            joined[e["output_index"]] = joined.get(e["output_index"], "") + e["delta"]
    finished = {
        e["output_index"]: e["item"] for e in streamed if e["type"] == "response.output_item.done"
    }
    final = streamed[-1]["response"]["output"]
    calls = [i for i, item in added.items() if item["type"] == "function_call"]
    if text == TWO_CALLS:
        assert [
            {k: v for k, v in item.items() if k not in ("id", "call_id")} for item in final
        ] == [
            {k: v for k, v in item.items() if k not in ("id", "call_id")}
            for item in unary["output"]
        ]
        assert (
            [joined[i] for i in calls]
            == [finished[i]["arguments"] for i in calls]
            == [item["arguments"] for item in final]
            == ['{"city": "Paris"}', '{"zone": "CET"}']
        )
        assert (
            len([e for e in streamed if e["type"] == "response.function_call_arguments.delta"]) > 2
        )
    else:  # abandoned: incomplete, out of the final output, which is the span as a message
        assert [finished[i]["status"] for i in calls] == ["incomplete"] and joined[
            calls[0]
        ] == MALFORMED[0][2]
        assert (
            {item["type"] for item in final}
            == {"message"}
            == {item["type"] for item in unary["output"]}
        )
        assert (
            "".join(item["content"][0]["text"] for item in final)
            == unary["output"][0]["content"][0]["text"]
            == text
        )
        assert not any(e["type"] == "response.function_call_arguments.done" for e in streamed)


@pytest.mark.parametrize("text", [TWO_CALLS, MALFORMED[0][1]])
def test_messages_stream_tool_use_input_as_json_deltas(text):
    from services.gateway.api.messages_api import Messages
    from services.gateway.prepare.requests import Prepared

    unary, streamed = _run(
        _surface(Messages),
        Prepared("msg-1", [None], 1, chat=True),
        None,
        _events("hermes", _pieces(text)),
    )
    blocks, joined = {}, {}
    for e in streamed:
        if e["type"] == "content_block_start":
            blocks[e["index"]] = e["content_block"]
        elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            joined[e["index"]] = joined.get(e["index"], "") + e["delta"]["partial_json"]
    stops = [e["index"] for e in streamed if e["type"] == "content_block_stop"]
    assert stops == sorted(blocks)  # each block closed once, in order
    reason = next(e for e in streamed if e["type"] == "message_delta")["delta"]["stop_reason"]
    assert reason == unary["stop_reason"]
    uses = [i for i, b in blocks.items() if b["type"] == "tool_use"]
    if text == TWO_CALLS:
        assert reason == "tool_use"
        assert [json.loads(joined[i]) for i in uses] == [b["input"] for b in unary["content"]]
        assert [blocks[i]["name"] for i in uses] == [b["name"] for b in unary["content"]]
    else:
        assert reason == "end_turn" and joined[uses[0]] == MALFORMED[0][2]
        assert unary["content"] == [{"type": "text", "text": text}]
        text_blocks = [i for i, b in blocks.items() if b["type"] == "text"]
        assert (
            "".join(
                e["delta"]["text"]
                for e in streamed
                if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"
            )
            == text
            and max(text_blocks) > uses[0]
        )
