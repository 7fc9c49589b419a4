"""The Responses and Messages APIs on the demo model through Envoy, driven by the official
openai and anthropic SDKs and by the OpenAI Agents SDK's tool loop: unary and streamed, a tool
call answered from its result, cached tokens in each API's own field, the same greedy tokens
as chat completions, and each API's error shape."""

from __future__ import annotations

import asyncio
import json
import os

import anthropic
import openai
import pytest

from demo.corpus import TOOLS
from deploy.processes import REPO_ROOT
from deploy.stack import start_stack

DEMO_MODEL = os.path.join(REPO_ROOT, "demo", "tandem-demo")
MODEL = "tandem-demo"
WEATHER = TOOLS["get_weather"]["function"]  # the tool as the demo model was trained to see it
RESPONSES_TOOL = {"type": "function", **WEATHER}
MESSAGES_TOOL = {
    "name": WEATHER["name"],
    "description": WEATHER["description"],
    "input_schema": WEATHER["parameters"],
}
QUESTION = "What's the weather like in Paris?"
RESULT = json.dumps({"city": "Paris", "temperature": 18, "unit": "celsius", "condition": "sunny"})
ANSWER = "It is 18 degrees celsius and sunny in Paris."
LONG_SYSTEM = "You are a helpful assistant. " * 20
STORED = 3  # the gateway keeps this many responses
# the current Anthropic SDK has no temperature argument: tandem takes it in the body
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def stack():
    stack = start_stack(
        DEMO_MODEL,
        gateway_args=(
            "--max-stored-responses",
            str(STORED),
            "--prices",
            "input:1,cached_input:0.1,output:2",
        ),
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(
        base_url=f"http://{stack.envoy_address}/v1", api_key="none", max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def claude(stack):
    return anthropic.Anthropic(
        base_url=f"http://{stack.envoy_address}", api_key="none", max_retries=0, timeout=60
    )


# Responses.


def test_responses_answer_unary_and_streamed_alike(oai):
    reply = oai.responses.create(model=MODEL, input="What is the capital of France?", temperature=0)
    assert reply.status == "completed" and "Paris" in reply.output_text
    assert reply.usage.input_tokens > 0 and reply.usage.output_tokens > 0
    events = list(
        oai.responses.create(
            model=MODEL, input="What is the capital of France?", temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert (
        "".join(e.delta for e in events if e.type == "response.output_text.delta")
        == reply.output_text
    )
    assert events[-1].response.output_text == reply.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_call_then_its_output_then_the_answer(oai, stream):
    args = dict(model=MODEL, temperature=0, tools=[RESPONSES_TOOL])
    if stream:
        events = list(oai.responses.create(input=QUESTION, stream=True, **args))
        kinds = [e.type for e in events]
        assert (
            "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        )
        first = events[-1].response
    else:
        first = oai.responses.create(input=QUESTION, **args)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Paris"
    # Continued from the stored response, and statelessly with the whole conversation again.
    output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
    followed = oai.responses.create(input=[output], previous_response_id=first.id, **args)
    resent = oai.responses.create(
        input=[
            {"role": "user", "content": QUESTION},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            output,
        ],
        **args,
    )
    assert followed.output_text == resent.output_text == ANSWER


def test_responses_report_cached_tokens_and_cost(oai):
    replies = [
        oai.responses.create(
            model=MODEL, instructions=LONG_SYSTEM, input="Hello!", max_output_tokens=4
        )
        for _ in range(2)
    ]
    usage = replies[1].usage
    assert usage.input_tokens == replies[0].usage.input_tokens
    assert usage.input_tokens_details.cached_tokens == (usage.input_tokens - 1) // 16 * 16 > 0
    assert (
        replies[1].status == "incomplete"
        and replies[1].incomplete_details.reason == "max_output_tokens"
    )
    cost = usage.model_extra["cost"]
    expected = (
        (usage.input_tokens - usage.input_tokens_details.cached_tokens) * 1
        + usage.input_tokens_details.cached_tokens * 0.1
        + usage.output_tokens * 2
    ) / 1e6
    assert cost == pytest.approx(expected)


def test_responses_errors(oai):
    with pytest.raises(openai.BadRequestError, match="not found") as error:
        oai.responses.create(model=MODEL, input="Hi", previous_response_id="resp_unknown")
    assert error.value.status_code == 400 and error.value.body["type"] == "invalid_request_error"
    # The store keeps STORED responses: the oldest of STORED + 1 can no longer be continued.
    ids = [
        oai.responses.create(model=MODEL, input="Hi", max_output_tokens=2).id
        for _ in range(STORED + 1)
    ]
    with pytest.raises(openai.BadRequestError, match="not found"):
        oai.responses.create(
            model=MODEL, input="Hi", previous_response_id=ids[0], max_output_tokens=2
        )
    oai.responses.create(model=MODEL, input="Hi", previous_response_id=ids[-1], max_output_tokens=2)
    unstored = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False).id
    with pytest.raises(openai.BadRequestError, match="not found"):
        oai.responses.create(
            model=MODEL, input="Hi", previous_response_id=unstored, max_output_tokens=2
        )
    for bad, match in [
        (dict(input=[{"type": "input_image", "image_url": "x"}]), "not supported"),
        (dict(input="Hi", tools=[{"type": "function"}]), "name must be a non-empty string"),
        (dict(input="Hi", reasoning={"effort": "maximal"}), "reasoning.effort"),
        (dict(input="Hi", truncation="auto"), "truncation"),
        (dict(input="Hi", extra_body={"frequency_penalty": 1}), "unrecognized request argument"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match):
            oai.responses.create(model=MODEL, **bad)


# Messages.


def test_messages_answer_unary_and_streamed_alike(claude):
    args = dict(
        model=MODEL,
        max_tokens=64,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    reply = claude.messages.create(**args)
    assert reply.stop_reason == "end_turn" and "Paris" in reply.content[0].text
    with claude.messages.stream(**args) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert (
        final.content[0].text == reply.content[0].text
        and final.usage.output_tokens == reply.usage.output_tokens
    )


@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_use_then_its_result_then_the_answer(claude, stream):
    args = dict(model=MODEL, max_tokens=64, extra_body=GREEDY, tools=[MESSAGES_TOOL])
    question = [{"role": "user", "content": QUESTION}]
    if stream:
        with claude.messages.stream(messages=question, **args) as events:
            first = events.get_final_message()
    else:
        first = claude.messages.create(messages=question, **args)
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert (
        first.stop_reason == "tool_use"
        and use.name == "get_weather"
        and use.input["city"] == "Paris"
    )
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}],
    }
    answer = claude.messages.create(
        messages=question + [{"role": "assistant", "content": first.content}, result], **args
    )
    assert answer.content[0].text == ANSWER and answer.stop_reason == "end_turn"


def test_messages_report_cache_reads_and_take_cache_control(claude):
    system = [{"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}]
    replies = [
        claude.messages.create(
            model=MODEL,
            max_tokens=4,
            system=system,
            messages=[{"role": "user", "content": "Hello!"}],
        )
        for _ in range(2)
    ]
    first, second = (r.usage for r in replies)
    prompt = first.input_tokens + first.cache_read_input_tokens
    assert second.cache_read_input_tokens == (prompt - 1) // 16 * 16 > 0
    assert second.input_tokens == prompt - second.cache_read_input_tokens
    assert second.model_extra["cost"] == pytest.approx(
        (second.input_tokens * 1 + second.cache_read_input_tokens * 0.1 + second.output_tokens * 2)
        / 1e6
    )
    assert replies[1].stop_reason == "max_tokens"


def test_messages_errors_in_anthropic_s_shape(claude, stack):
    with pytest.raises(anthropic.BadRequestError) as error:
        claude.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                }
            ],
        )
    assert error.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": (
                "messages.0.content.0: 'image' content is not supported: tandem serves text only (a multimodal "
                "checkpoint's vision and audio encoders are not loaded); send text, tool_result parts"
            ),
        },
    }
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=0
        )
    with pytest.raises(anthropic.NotFoundError) as error:
        claude.messages.create(
            model="claude-opus", max_tokens=8, messages=[{"role": "user", "content": "Hi"}]
        )
    assert error.value.body["error"]["type"] == "not_found_error"


# All three.


def test_the_same_greedy_request_gives_the_same_tokens_through_every_api(oai, claude):
    question = "Tell me about colours."
    chat = oai.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=40,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": question},
        ],
    )
    responses = oai.responses.create(
        model=MODEL, temperature=0, max_output_tokens=40, instructions="Be brief.", input=question
    )
    messages = claude.messages.create(
        model=MODEL,
        extra_body=GREEDY,
        max_tokens=40,
        system="Be brief.",
        messages=[{"role": "user", "content": question}],
    )
    assert chat.choices[0].message.content == responses.output_text == messages.content[0].text
    assert (
        chat.usage.completion_tokens
        == responses.usage.output_tokens
        == messages.usage.output_tokens
    )
    assert (
        chat.usage.prompt_tokens
        == responses.usage.input_tokens
        == messages.usage.input_tokens + messages.usage.cache_read_input_tokens
    )


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agents_sdk_tool_loop_runs_to_its_end(stack, streamed):
    from agents import (
        Agent,
        FunctionTool,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls = []

    async def get_weather(context, arguments: str) -> str:
        calls.append(json.loads(arguments))
        return RESULT

    tool = FunctionTool(
        name=WEATHER["name"],
        description=WEATHER["description"],
        params_json_schema=WEATHER["parameters"],
        on_invoke_tool=get_weather,
        strict_json_schema=False,
    )
    client = openai.AsyncOpenAI(
        base_url=f"http://{stack.envoy_address}/v1", api_key="none", max_retries=0
    )
    agent = Agent(
        name="weather",
        tools=[tool],
        model=OpenAIResponsesModel(MODEL, client),
        model_settings=ModelSettings(temperature=0),
    )

    async def run():
        if not streamed:
            return await Runner.run(agent, QUESTION, max_turns=4)
        result = Runner.run_streamed(agent, QUESTION, max_turns=4)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return result

    result = asyncio.run(run())
    assert [call["city"] for call in calls] == ["Paris"]
    assert result.final_output == ANSWER
