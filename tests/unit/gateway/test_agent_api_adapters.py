"""The Responses and Messages adapters' conversions to chat messages and tools, their refusals,
Anthropic's usage, and the response store's bounds."""

from __future__ import annotations

import json

import grpc
import pytest

from services.gateway.api import messages_api, responses_api
from services.gateway.api.response_store import ResponseStore
from services.gateway.errors import GatewayError
from services.gateway.protocol import Usage

CALL = {
    "type": "function_call",
    "call_id": "call_1",
    "name": "get_weather",
    "arguments": '{"city": "Paris"}',
}


def test_responses_input_becomes_chat_messages():
    assert responses_api.input_messages("Hi") == [{"role": "user", "content": "Hi"}]
    messages = responses_api.input_messages(
        [
            {"role": "developer", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather "},
                    {"type": "input_text", "text": "in Paris?"},
                ],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            CALL,
            {**CALL, "call_id": "call_2"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]
    )
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [  # the calls join the turn they follow
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert responses_api.input_messages([CALL])[0] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    }


def test_a_responses_reasoning_item_is_the_reasoning_of_the_turn_it_precedes():
    """As this gateway writes them (reasoning_text content): the next assistant turn's
    reasoning_content; another provider's encrypted thoughts, and reasoning that no assistant
    turn follows, are left out."""
    thought = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "r"}],
    }
    encrypted = {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    messages = responses_api.input_messages(
        [
            {"role": "user", "content": "Weather?"},
            thought,
            CALL,
            output,
            encrypted,
            {"role": "assistant", "content": "Sunny."},
            thought,
            {"role": "user", "content": "Thanks"},
        ]
    )
    assert [m.get("reasoning_content") for m in messages] == [None, "r", None, None, None]
    assert messages[1]["tool_calls"][0]["id"] == "call_1"


@pytest.mark.parametrize(
    "items, match",
    [
        ([], "must not be empty"),
        (
            [{"type": "reasoning", "summary": []}],
            "must not be empty",
        ),  # skipped: another provider's thoughts
        ([{"type": "computer_call", "id": "c"}], "'computer_call' are not supported"),
        (
            [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
            "'input_image' content is not supported: tandem serves text only",
        ),
        ([{"role": "tool", "content": "x"}], "role must be"),
        ([{"type": "function_call_output", "output": "x"}], "call_id must be a non-empty string"),
    ],
)
def test_responses_input_refusals(items, match):
    with pytest.raises(GatewayError, match=match) as error:
        responses_api.input_messages(items)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_responses_tools_choice_and_format_map_to_chat():
    tool = {
        "type": "function",
        "name": "f",
        "description": "d",
        "parameters": {"type": "object"},
        "strict": True,
    }
    [mapped], left_out = responses_api.chat_tools([tool])
    assert left_out == []
    assert mapped == {
        "type": "function",
        "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
    }
    # chat's order: templates render JSON
    assert list(mapped["function"]) == ["name", "description", "parameters"]
    assert responses_api.chat_tool_choice({"type": "function", "name": "f"}) == {
        "type": "function",
        "function": {"name": "f"},
    }
    assert responses_api.chat_tool_choice("required") == "required"
    assert responses_api.response_format(
        {"format": {"type": "json_schema", "name": "n", "schema": {}}}
    ) == {"type": "json_schema", "json_schema": {"name": "n", "schema": {}}}
    assert responses_api.response_format({"format": {"type": "text"}}) is None
    with pytest.raises(GatewayError):
        responses_api.chat_tools([{"type": "function"}])
    # Namespaces are flattened; hosted tools are left out (and named), not refused.
    namespace = {"type": "namespace", "name": "agents", "tools": [tool, {**tool, "name": "g"}]}
    tools, left_out = responses_api.chat_tools(
        [namespace, {"type": "web_search", "external_web_access": False}]
    )
    assert [t["function"]["name"] for t in tools] == ["f", "g"] and left_out == ["web_search"]
    assert responses_api.chat_tools([{"type": "web_search"}]) == (None, ["web_search"])
    assert responses_api.reasoning_switch({"summary": "auto"}) is None
    assert responses_api.reasoning_switch({"effort": "high"}) is True
    assert responses_api.reasoning_switch({"effort": "minimal"}) is False


def test_messages_become_chat_messages():
    messages = messages_api.chat_messages(
        [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me look."},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "sunny"}],
                    },
                    {
                        "type": "text",
                        "text": "And tomorrow?",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
        ],
    )
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "at least one message"),
        ([{"role": "tool", "content": "x"}], "must be user, assistant or system"),
        ([{"role": "user", "content": "x", "name": "n"}], "messages.0.name: Extra inputs"),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                }
            ],
            r"'tool_use' content is not supported here \(text, tool_result\)",
        ),
        (
            [{"role": "user", "content": [{"type": "document", "source": {}}]}],
            "'document' content is not supported: tandem serves text only",
        ),
    ],
)
def test_messages_refusals(messages, match):
    with pytest.raises(GatewayError, match=match):
        messages_api.chat_messages(None, messages)


def test_messages_system_turns_errors_and_the_volatile_billing_header():
    messages = messages_api.chat_messages(
        [
            {
                "type": "text",
                "text": "x-anthropic-billing-header: cc_version=2.1.197.84c; cc_entrypoint=sdk-cli;",
            },
            {"type": "text", "text": "You are an agent."},
        ],
        [
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Agent types: ..."},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": "boom", "is_error": True}
                ],
            },
        ],
    )
    assert messages == [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Agent types: ..."},
        {"role": "tool", "tool_call_id": "t", "content": "boom", "is_error": True},
    ]
    assert messages_api.reasoning_switch({"type": "adaptive"}) is True
    assert messages_api.reasoning_switch({"type": "disabled"}) is False
    with pytest.raises(GatewayError, match="thinking.type"):
        messages_api.reasoning_switch({"type": "sometimes"})


def test_the_context_limit_in_anthropics_own_words():
    from services.gateway.errors import ContextLimit

    too_much = ContextLimit(49058, 32000, 65536, "over")
    assert messages_api.context_limit_message(too_much) == (
        "input length and `max_tokens` exceed context limit: 49058 + 32000 > 65536, decrease input length or "
        "`max_tokens` and try again"
    )
    assert (
        messages_api.context_limit_message(ContextLimit(70000, None, 65536, "over"))
        == "prompt is too long: 70000 tokens > 65536 maximum"
    )


def test_messages_tools_choice_and_usage():
    [tool], left_out = messages_api.chat_tools(
        [{"name": "f", "description": "d", "input_schema": {"type": "object"}}]
    )
    assert tool == {
        "type": "function",
        "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
    }
    assert messages_api.chat_tools([{"type": "web_search_20250305", "name": "web_search"}]) == (
        None,
        ["web_search"],
    )
    assert messages_api.chat_tool_choice({"type": "any"}) == "required"
    assert messages_api.chat_tool_choice({"type": "tool", "name": "f"}) == {
        "type": "function",
        "function": {"name": "f"},
    }
    # Anthropic's input_tokens leave out the cache reads.
    assert messages_api.usage_json(
        Usage(prompt_tokens=100, completion_tokens=7, cached_tokens=64)
    ) == {
        "input_tokens": 36,
        "output_tokens": 7,
        "cache_read_input_tokens": 64,
        "cache_creation_input_tokens": 0,
    }


def test_response_store_bounds():
    now = [0.0]
    store = ResponseStore(max_responses=2, ttl_s=10, max_messages=3, clock=lambda: now[0])
    assert store.put("a", [{"role": "user", "content": "1"}]) and store.put("b", [])
    assert store.get("a") == [{"role": "user", "content": "1"}]
    store.put("c", [])  # over max_responses: the oldest goes
    assert store.get("a") is None and store.get("b") == [] and len(store) == 2
    assert not store.put("d", [{}] * 4)  # over max_messages: not kept
    now[0] = 10.0  # b and c expire
    assert store.get("b") is None and store.get("c") is None and len(store) == 0
    assert not ResponseStore(max_responses=0).put("e", [])
