"""Tool-call parsing from streamed text."""

from __future__ import annotations

import json

import pytest

from services.gateway.tool_calls import ToolCallParser

TEXT = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> Done.'


def run(parser: ToolCallParser, pieces: list[str]):
    content, calls = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content += text
        calls += new
    return content + parser.finish(), calls


@pytest.mark.parametrize("size", [1, 3, 7, len(TEXT)])
def test_tool_call_is_parsed_whatever_the_chunking(size):
    content, calls = run(ToolCallParser(), [TEXT[i : i + size] for i in range(0, len(TEXT), size)])
    assert content == "Let me check.  Done."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id.startswith("call_")


def test_text_resembling_a_tag_is_shown_once_it_is_not_one():
    parser = ToolCallParser()
    assert parser.feed("a <tool") == ("a ", [])
    assert parser.feed("box> b") == ("<toolbox> b", [])


def test_invalid_json_and_unclosed_calls_come_back_as_text():
    content, calls = run(ToolCallParser(), ["<tool_call>{not json}</tool_call> and <tool_call>{\"name\": \"x\""])
    assert calls == []
    assert content == '<tool_call>{not json}</tool_call> and <tool_call>{"name": "x"'


def test_two_calls_and_string_encoded_arguments():
    text = ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = run(ToolCallParser(), [text])
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("get_time", {})]
