"""The shipped demo model through the whole stack and Envoy, driven by the official openai client."""

from __future__ import annotations

import json
import os

import openai
import pytest

from demo.corpus import TOOLS
from deploy.processes import REPO_ROOT
from deploy.stack import start_stack

DEMO_MODEL = os.path.join(REPO_ROOT, "demo", "tandem-demo")
# The tool as the demo model was trained to see it (a tiny model does not generalise to others).
WEATHER_TOOL = TOOLS["get_weather"]


@pytest.fixture(scope="module")
def client():
    stack = start_stack(DEMO_MODEL)
    yield openai.OpenAI(
        base_url=f"http://{stack.envoy_address}/v1", api_key="none", max_retries=0, timeout=60
    )
    stack.stop()


def test_chat_answers_in_readable_text_streamed_and_not(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="tandem-demo", messages=messages, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model="tandem-demo", messages=messages, temperature=0, stream=True
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == reply.choices[0].message.content
    )


# Paris is in the training corpus; Lyon and Kyoto never are (demo/copy_check.py's held-out cities):
# the model copies them from the question.
@pytest.mark.parametrize(
    "stream,city", [(False, "Paris"), (True, "Paris"), (False, "Lyon"), (True, "Kyoto")]
)
def test_tool_call_comes_back_with_the_city_asked_for(client, stream, city):
    args = dict(
        model="tandem-demo",
        temperature=0,
        tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": f"What's the weather like in {city}?"}],
    )
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **args):
            for delta in chunk.choices[0].delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        [call] = calls.values()
    else:
        reply = client.chat.completions.create(**args)
        finish = reply.choices[0].finish_reason
        [tool_call] = reply.choices[0].message.tool_calls
        call = {"name": tool_call.function.name, "arguments": tool_call.function.arguments}
    assert finish == "tool_calls"
    assert call["name"] == "get_weather"
    arguments = json.loads(call["arguments"])
    assert arguments["city"] == city


def test_repeated_long_prompt_reports_cached_tokens(client):
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " * 20},
        {"role": "user", "content": "Hello!"},
    ]
    first = client.chat.completions.create(model="tandem-demo", messages=messages, max_tokens=4)
    second = client.chat.completions.create(model="tandem-demo", messages=messages, max_tokens=4)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert (
        second.usage.prompt_tokens_details.cached_tokens
        == (second.usage.prompt_tokens - 1) // 16 * 16
        > 0
    )


def test_seed_reproduces_a_sampled_reply(client):
    messages = [{"role": "user", "content": "Tell me about colours."}]
    replies = [
        client.chat.completions.create(
            model="tandem-demo", messages=messages, temperature=1.0, seed=11, max_tokens=24
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert replies[0] == replies[1]
