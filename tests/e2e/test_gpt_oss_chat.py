"""gpt-oss's chat through `make run MODEL=`, as OpenAI publishes it (MXFP4 experts, no tokenizer
files: o200k_harmony) and rigged to answer the weather question in harmony with its analysis and
a call: the openai and anthropic SDKs get the analysis as reasoning and the call as tool_calls /
function_call / tool_use, unary and streamed; the prompt, and a round trip with the tool's
result through each API, count the tokens openai-harmony renders for the same conversation."""

from __future__ import annotations

import os

import anthropic
import openai
import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from engine.o200k import VOCAB_SIZE, harmony_encoding
from tests.e2e.test_published_checkpoints import (
    WEATHER_QUESTION,
    WEATHER_TOOL,
    served,
    streamed_calls,
)
from tests.unit.gateway.test_harmony import assistant, call

THOUGHT, ARGUMENTS, RESULT = "The user wants the weather.", '{"city": "Paris"}', "sunny, 21 C"
# As gpt-oss writes a call: the recipient after the channel (openai-harmony renders it before;
# tests/unit/gateway/test_harmony.py reads both).
REPLY = (
    f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>commentary"
    f" to=functions.get_weather <|constrain|>json<|message|>{ARGUMENTS}<|call|>"
)
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather",
    "parameters": WEATHER_TOOL["function"]["parameters"],
}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "Current weather",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}


def harmony_prompt(*turn: Message) -> list[int]:
    """openai-harmony's prompt for the weather question with the tool, then `turn`: the
    gateway's defaults (medium effort, no date), `<|start|>assistant` last."""
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort.MEDIUM)
    developer = DeveloperContent.new().with_function_tools(
        [ToolDescription.new("get_weather", TOOL["description"], TOOL["parameters"])]
    )
    conversation = [
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, WEATHER_QUESTION["content"]),
        *turn,
    ]
    return harmony_encoding().render_conversation_for_completion(
        Conversation.from_messages(conversation), Role.ASSISTANT
    )


def round_trip() -> list[int]:
    """The call answered: its analysis kept (the turn goes on), the result from
    functions.get_weather."""
    return harmony_prompt(
        assistant(THOUGHT, "analysis"),
        call(ARGUMENTS),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), RESULT)
        .with_channel("commentary")
        .with_recipient("assistant"),
    )


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> str:
    """A tiny gpt-oss (128 wide, to be rigged; the full o200k_harmony vocabulary) rigged to
    write REPLY after the gateway's prompt for the weather question."""
    import torch
    from safetensors.torch import load_file, save_file

    from services.gateway.prepare.requests import ServedModel, chat_prompt
    from services.gateway.protocol import ChatRequest, SamplingOptions
    from tests.tiny_models import build_hf_model, mxfp4_layout, rig_reply

    folder = str(tmp_path_factory.mktemp("published") / "gpt-oss-20b")
    model = build_hf_model("gpt_oss", vocab_size=VOCAB_SIZE, hidden_size=128)
    model.save_pretrained(folder)
    reference = mxfp4_layout(folder, model)
    served_model = ServedModel.from_folder(folder)
    prompt = chat_prompt(
        ChatRequest(messages=[WEATHER_QUESTION], options=SamplingOptions(), tools=[WEATHER_TOOL]),
        served_model,
    )
    assert prompt == harmony_prompt()
    rig_reply(reference, prompt, harmony_encoding().encode(REPLY, allowed_special="all"))
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    weights["lm_head.weight"] = reference.lm_head.weight.detach().to(torch.float32).contiguous()
    save_file(weights, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def url(gpt_oss):
    with served(gpt_oss) as url:
        yield url


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture
def claude(url):
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60)


def ask(gpt_oss: str, **more) -> dict:
    return dict(
        model=os.path.basename(gpt_oss),
        messages=[WEATHER_QUESTION],
        tools=[WEATHER_TOOL],
        max_tokens=100,
        temperature=0,
        **more,
    )


def test_chat_gives_the_analysis_as_reasoning_and_the_call_as_tool_calls(gpt_oss, client):
    reply = client.chat.completions.create(**ask(gpt_oss))
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content in ("", None) and message.model_extra["reasoning_content"] == THOUGHT
    [tool_call] = message.tool_calls
    assert (tool_call.function.name, tool_call.function.arguments) == ("get_weather", ARGUMENTS)
    assert reply.usage.prompt_tokens == len(harmony_prompt())
    assert reply.usage.completion_tokens_details.reasoning_tokens == len(
        harmony_encoding().encode(THOUGHT)
    )

    chunks = list(client.chat.completions.create(**ask(gpt_oss), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ""
    assert [c[1:] for c in streamed_calls(deltas)] == [("get_weather", ARGUMENTS)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_responses_and_messages_give_reasoning_and_the_call(gpt_oss, client, claude):
    name = os.path.basename(gpt_oss)
    asked = dict(model=name, input=[WEATHER_QUESTION], tools=[TOOL], temperature=0)
    response = client.responses.create(**asked, max_output_tokens=100)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    assert response.output[0].content[0].text == THOUGHT
    assert (response.output[1].name, response.output[1].arguments) == ("get_weather", ARGUMENTS)
    assert response.usage.input_tokens == len(harmony_prompt())
    events = list(client.responses.create(**asked, max_output_tokens=100, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert [i.type for i in events[-1].response.output] == ["reasoning", "function_call"]
    assert events[-1].response.output[1].arguments == ARGUMENTS

    asked = dict(model=name, max_tokens=100, messages=[WEATHER_QUESTION], tools=[ANTHROPIC_TOOL])
    message = claude.messages.create(**asked)
    assert [b.type for b in message.content] == ["thinking", "tool_use"]
    assert message.stop_reason == "tool_use" and message.content[0].thinking == THOUGHT
    assert (message.content[1].name, message.content[1].input) == ("get_weather", {"city": "Paris"})
    with claude.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == THOUGHT and final.content[1].input == {"city": "Paris"}


def test_a_tool_result_round_trip_renders_as_openai_harmony_does(gpt_oss, client, claude):
    """The call and its analysis sent back, then the result, in each API's own shape: the same
    prompt as openai-harmony's (only the prompt is checked, so one token is asked for)."""
    name = os.path.basename(gpt_oss)
    reply = client.chat.completions.create(**ask(gpt_oss))
    message = reply.choices[0].message
    [tool_call] = message.tool_calls
    history = [
        WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": message.model_extra["reasoning_content"],
            "tool_calls": [tool_call.model_dump()],
        },
        {"role": "tool", "tool_call_id": tool_call.id, "content": RESULT},
    ]
    turn = client.chat.completions.create(
        model=name, messages=history, tools=[WEATHER_TOOL], max_tokens=1
    )
    assert turn.usage.prompt_tokens == len(round_trip())

    # Responses: the output items as they came, then the call's output.
    response = client.responses.create(
        model=name, input=[WEATHER_QUESTION], tools=[TOOL], temperature=0, max_output_tokens=100
    )
    function_call = response.output[1]
    items = [
        WEATHER_QUESTION,
        *(item.model_dump(exclude_none=True) for item in response.output),
        {"type": "function_call_output", "call_id": function_call.call_id, "output": RESULT},
    ]
    turn = client.responses.create(model=name, input=items, tools=[TOOL], max_output_tokens=1)
    assert turn.usage.input_tokens == len(round_trip())
    turn = client.responses.create(  # the stored response instead
        model=name,
        previous_response_id=response.id,
        input=items[-1:],
        tools=[TOOL],
        max_output_tokens=1,
    )
    assert turn.usage.input_tokens == len(round_trip())

    # Messages: the assistant's blocks as they came, then a tool_result.
    message = claude.messages.create(
        model=name, max_tokens=100, messages=[WEATHER_QUESTION], tools=[ANTHROPIC_TOOL]
    )
    messages = [
        WEATHER_QUESTION,
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": message.content[1].id, "content": RESULT}
            ],
        },
    ]
    turn = claude.messages.create(
        model=name, max_tokens=1, messages=messages, tools=[ANTHROPIC_TOOL]
    )
    usage = turn.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(round_trip())
