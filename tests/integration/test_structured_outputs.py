"""Structured outputs through the whole stack with the OpenAI SDK, on the demo model:
`json_schema` replies parse and follow the schema, `json_object` replies are objects,
`tool_choice` required or named forces one valid call; all of it identical with speculation
on (prompt lookup) and off; a schema that cannot be enforced gets a 400."""

from __future__ import annotations

import json
import os

import openai
import pytest

from deploy.stack import start_stack

DEMO_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "demo", "tandem-demo")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
    },
    "required": ["city", "temperature"],
    "additionalProperties": False,
}


def ask_all(client) -> list:
    def chat(content, **kwargs):
        return client.chat.completions.create(
            model="tandem-demo",
            messages=[{"role": "user", "content": content}],
            max_tokens=60,
            temperature=0,
            **kwargs,
        )

    return [
        chat(
            "What's the weather in Paris?",
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "weather", "schema": SCHEMA},
            },
        ),
        chat("Hello! How are you?", response_format={"type": "json_object"}),
        chat("Hello there.", tools=[WEATHER, TIME], tool_choice="required"),
        chat(
            "What's the weather in Oslo?",
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        ),
    ]


@pytest.fixture(scope="module")
def replies():
    out = {}
    for speculative in ("off", "ngram"):
        stack = start_stack(
            DEMO_MODEL,
            worker_args=("--kv-cache-bytes", str(16 << 20), "--speculative", speculative),
        )
        try:
            client = openai.OpenAI(
                base_url=f"http://{stack.openai_address}/v1", api_key="none", max_retries=0
            )
            out[speculative] = ask_all(client)
            if speculative == "off":
                with pytest.raises(openai.BadRequestError) as refused:
                    client.chat.completions.create(
                        model="tandem-demo",
                        messages=[{"role": "user", "content": "hi"}],
                        max_tokens=4,
                        response_format={
                            "type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"type": 7}},
                        },
                    )
                out["refused"] = refused.value.body["message"]
        finally:
            stack.stop()
    return out


def test_json_replies_follow_the_schema(replies):
    weather = json.loads(replies["off"][0].choices[0].message.content)
    assert set(weather) == {"city", "temperature"} and isinstance(weather["temperature"], int)
    assert -50 <= weather["temperature"] <= 60 and len(weather["city"]) <= 20
    # an object, unless max_tokens cut it short (as OpenAI's would be)
    anything = replies["off"][1].choices[0]
    assert anything.message.content.startswith("{")
    assert anything.finish_reason == "length" or isinstance(
        json.loads(anything.message.content), dict
    )


def test_a_forced_tool_choice_gives_one_valid_call(replies):
    required, named = replies["off"][2].choices[0], replies["off"][3].choices[0]
    for choice in (required, named):
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = required.message.tool_calls[0].function
    arguments = json.loads(call.arguments)
    assert call.name in ("get_weather", "get_time")
    assert set(arguments) == ({"city", "unit"} if call.name == "get_weather" else {"timezone"})
    assert named.message.tool_calls[0].function.name == "get_time"
    assert set(json.loads(named.message.tool_calls[0].function.arguments)) == {"timezone"}


def test_speculation_changes_no_structured_reply(replies):
    def shape(reply):
        message = reply.choices[0].message
        return message.content, [
            (c.function.name, c.function.arguments) for c in message.tool_calls or []
        ]

    assert [shape(r) for r in replies["ngram"]] == [shape(r) for r in replies["off"]]


def test_a_schema_that_cannot_be_enforced_gets_a_400(replies):
    assert "schema" in replies["refused"]
