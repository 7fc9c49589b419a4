"""gpt-oss's harmony through the gateway: the prompt tokens are openai-harmony's own rendering
of the conversation (system prompt, tools, a call and its result, the reasoning effort, earlier
analysis dropped as harmony drops it), and replies written in harmony (rendered by openai-harmony
as the model would write them) come back as reasoning, tool calls and content in chat, Responses
and Messages, unary and streamed, however the worker groups the tokens."""

from __future__ import annotations

import asyncio
import functools
import json

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

from engine.o200k import harmony_encoding
from engine.tokenizer import Tokenizer
from services.gateway.api import openai_replies
from services.gateway.output import reasoning, tool_formats
from services.gateway.output.generation import generation_events
from services.gateway.output.tool_streams import ARGUMENTS, START
from services.gateway.prepare import requests
from services.gateway.protocol import ChatRequest, Delta, Finish, GenerationRequest, SamplingOptions
from tests.unit.gateway.test_reasoning import ScriptedPool, _surface

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "The user wants the weather.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


@functools.cache
def served_model() -> requests.ServedModel:
    """A gpt-oss model as the gateway sees it, from a tokenizer-only folder (config.json's
    model_type: the formats are detected from it, the vocabulary is the built-in o200k_harmony)."""
    import tempfile

    folder = tempfile.mkdtemp()
    with open(f"{folder}/config.json", "w") as f:
        json.dump({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}, f)
    return requests.ServedModel(
        name="gpt-oss",
        tokenizer=Tokenizer(folder),
        max_model_len=4096,
        vocab_size=201088,
        tool_format=tool_formats.detect(None, "gpt_oss"),
        reasoning_format=reasoning.detect(None, "gpt_oss"),
    )


def assistant(text: str, channel: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def weather_result() -> Message:
    """The weather tool's result, as harmony renders a tool's message."""
    return (
        Message.from_author_and_content(
            Author.new(Role.TOOL, "functions.get_weather"), "sunny, 21 C"
        )
        .with_channel("commentary")
        .with_recipient("assistant")
    )


def call(arguments: str) -> Message:
    return (
        assistant(arguments, "commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json")
    )


def reference(effort: ReasoningEffort, history: list[Message]) -> list[int]:
    system = SystemContent.new().with_reasoning_effort(effort)
    developer = (
        DeveloperContent.new()
        .with_instructions("Be brief.")
        .with_function_tools([ToolDescription.new(**WEATHER)])
    )
    conversation = [
        Message.from_role_and_content(Role.SYSTEM, system),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        *history,
    ]
    return harmony_encoding().render_conversation_for_completion(
        Conversation.from_messages(conversation), Role.ASSISTANT
    )


def test_the_prompt_is_openai_harmony_s_rendering_of_the_conversation():
    model = served_model()
    assert model.harmony
    tools = [{"type": "function", "function": WEATHER}]
    result = weather_result()
    history = [
        assistant("The user wants the weather.", "analysis"),
        call('{"city":"Paris"}'),
        result,
    ]
    request = ChatRequest(CONVERSATION, SamplingOptions(), tools=tools, reasoning_effort="high")
    prompt = requests.chat_prompt(request, model)
    assert prompt == reference(ReasoningEffort.HIGH, history)
    assert "The user wants the weather." in harmony_encoding().decode(prompt)  # its turn goes on

    # The turn answered, and a new question: its analysis is dropped, as harmony drops it.
    later = [
        *CONVERSATION,
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    request = ChatRequest(later, SamplingOptions(), tools=tools)  # no effort: medium
    prompt = requests.chat_prompt(request, model)
    more = [assistant("Sunny.", "final"), Message.from_role_and_content(Role.USER, "Thanks")]
    assert prompt == reference(ReasoningEffort.MEDIUM, history + more)
    assert "The user wants the weather." not in harmony_encoding().decode(prompt)


def reply(*messages: Message) -> list[int]:
    """The tokens the model writes after the prompt's `<|start|>assistant`."""
    tokens = [t for m in messages for t in harmony_encoding().render(m)]
    return tokens[2:]  # <|start|>assistant


# analysis, a preamble on commentary, then a call (ending in <|call|>)
CALL_REPLY = (
    assistant("The user wants the weather, é 😀.", "analysis"),
    assistant("Checking the weather.", "commentary"),
    call('{"city": "Paris"}'),
)
# analysis, then the answer on final (ending in <|return|>)
FINAL_REPLY = (assistant("Easy.", "analysis"), assistant("It is sunny in Paris.", "final"))


def events(tokens: list[int], size: int, tools: bool = True) -> list:
    model = served_model()
    request = GenerationRequest("r", [1], SamplingOptions(max_tokens=100))
    groups = [tokens[i : i + size] for i in range(0, len(tokens), size)]

    async def run():
        return [
            e
            async for e in generation_events(
                ScriptedPool(groups).generate(request),
                model.tokenizer,
                request,
                0,
                model.tool_format if tools else None,
                0.0,
                model.reasoning_format,
            )
        ]

    return asyncio.run(run())


def read(events: list) -> tuple[str, str, list, Finish]:
    deltas = [e for e in events if isinstance(e, Delta)]
    calls = [(c.name, json.loads(c.arguments)) for d in deltas for c in d.tool_calls]
    streamed = "".join(
        c.arguments for d in deltas for c in d.call_deltas if c.kind in (START, ARGUMENTS)
    )
    assert all(streamed == c.arguments for d in deltas for c in d.tool_calls)
    finish = next(e for e in events if isinstance(e, Finish))
    return "".join(d.reasoning for d in deltas), "".join(d.text for d in deltas), calls, finish


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_harmony_reply_reads_as_reasoning_calls_and_content_however_it_is_grouped(size):
    thought, content, calls, finish = read(events(reply(*CALL_REPLY), size))
    assert thought == "The user wants the weather, é 😀."
    assert content == "Checking the weather."
    assert calls == [("get_weather", {"city": "Paris"})] and finish.reason == "tool_calls"
    assert finish.usage.reasoning_tokens == len(harmony_encoding().encode(thought))

    written = (  # the recipient after the channel, as gpt-oss writes it
        "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>commentary to=functions"
        '.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    )
    got = read(events(harmony_encoding().encode(written, allowed_special="all"), size))
    assert got[:3] == ("Hm.", "", [("get_weather", {"city": "Paris"})])

    thought, content, calls, finish = read(events(reply(*FINAL_REPLY), size))
    assert (thought, content, calls, finish.reason) == (
        "Easy.",
        "It is sunny in Paris.",
        [],
        "stop",
    )


def test_without_tools_a_call_is_text_and_a_broken_reply_is_shown_as_it_is():
    _, content, calls, finish = read(events(reply(*CALL_REPLY), 2, tools=False))
    assert content == 'Checking the weather.{"city": "Paris"}' and not calls
    assert finish.reason == "stop"
    broken = harmony_encoding().encode("no header at all")
    assert read(events(broken, 2))[1] == "no header at all"
    # a call whose arguments are not a JSON object is abandoned and shown as text
    _, content, calls, finish = read(events(reply(call("Paris")), 1))
    assert (content, calls, finish.reason) == ("Paris", [], "stop")


def surfaces_of(tokens: list[int], size: int) -> dict:
    """The reply through each API, unary and streamed."""
    from services.gateway.api.messages_api import Messages
    from services.gateway.api.response_store import ResponseStore
    from services.gateway.api.responses_api import Responses, ResponsesBody, ResponsesCall
    from services.gateway.prepare.requests import Prepared

    replied = events(tokens, size)

    async def stream():
        for event in replied:
            yield event

    messages, responses = _surface(Messages), _surface(Responses)
    responses.store = ResponseStore(10, 60)
    call = ResponsesCall(ResponsesBody(input="w"), [{"role": "user", "content": "w"}], "resp_1")
    chat = Prepared("chatcmpl-1", [None], 1, chat=True)

    async def run():
        return {
            "chat": await openai_replies.chat_completion(chat, "m", None, stream()),
            "chat_stream": [
                c async for c in openai_replies.chat_chunks(chat, "m", None, stream(), False)
            ],
            "responses": await responses.unary(
                Prepared("resp-1", [None], 1, chat=True), call, stream()
            ),
            "responses_stream": [
                e
                async for e in responses.chunks(
                    Prepared("resp-1", [None], 1, chat=True), call, stream()
                )
            ],
            "messages": await messages.unary(
                Prepared("msg-1", [None], 1, chat=True), None, stream()
            ),
            "messages_stream": [
                e
                async for e in messages.chunks(
                    Prepared("msg-1", [None], 1, chat=True), None, stream()
                )
            ],
        }

    return asyncio.run(run())


@pytest.mark.parametrize("size", [1, 5])
def test_each_api_gives_harmony_s_reasoning_and_call_unary_and_streamed(size):
    thought, arguments = "The user wants the weather, é 😀.", '{"city": "Paris"}'
    out = surfaces_of(reply(*CALL_REPLY), size)

    message = out["chat"]["choices"][0]["message"]
    assert message["reasoning_content"] == thought and message["content"] == "Checking the weather."
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": arguments}
    deltas = [c["choices"][0]["delta"] for c in out["chat_stream"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thought
    streamed = "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", []))
    assert streamed == arguments

    items = out["responses"]["output"]
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": thought}]
    assert items[2]["name"] == "get_weather" and items[2]["arguments"] == arguments
    stream = out["responses_stream"]
    assert (
        "".join(e["delta"] for e in stream if e["type"] == "response.reasoning_text.delta")
        == thought
    )
    assert (
        "".join(e["delta"] for e in stream if e["type"] == "response.function_call_arguments.delta")
        == arguments
    )

    blocks = out["messages"]["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0]["thinking"] == thought and blocks[2]["input"] == {"city": "Paris"}
    assert out["messages"]["stop_reason"] == "tool_use"
    stream = out["messages_stream"]
    thinking = [e["delta"] for e in stream if e["type"] == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in thinking) == thought
    assert "".join(d.get("partial_json", "") for d in thinking) == arguments


def test_each_api_s_reasoning_effort_sets_the_system_message_s_level():
    from services.gateway.api.messages_api import Messages, MessagesBody
    from services.gateway.api.openai_models import ChatCompletionBody
    from services.gateway.api.responses_api import Responses, ResponsesBody, ResponsesCall

    model = served_model()
    user = [{"role": "user", "content": "Hi"}]

    def level(prepared) -> str:
        prompt = harmony_encoding().decode(prepared.generations[0].prompt_token_ids)
        return prompt.split("Reasoning: ")[1].split("\n")[0]

    chat = ChatCompletionBody(messages=user, reasoning_effort="low").to_request()
    assert level(requests.chat(chat, model)) == "low"
    body = ResponsesBody(input="Hi", reasoning={"effort": "high"})
    responses = _surface(Responses, model=model)
    assert level(responses.prepare(ResponsesCall(body, user, "resp_1"), "")) == "high"
    body = MessagesBody(model="", max_tokens=9, messages=user, output_config={"effort": "low"})
    assert level(_surface(Messages, model=model).prepare(body, "")) == "low"
    with pytest.raises(Exception, match="reasoning effort must be one of"):
        requests.chat(
            ChatCompletionBody(messages=user, reasoning_effort="huge").to_request(), model
        )


def test_forced_calls_and_json_replies_are_constrained_in_harmony_s_markup():
    from engine.grammar import GrammarCompiler
    from services.gateway.prepare.structured import chat_grammar

    model = served_model()
    tokenizer = model.tokenizer
    compiler = GrammarCompiler(tokenizer, list(tokenizer.eos_token_ids), 201088)
    tools = [{"type": "function", "function": WEATHER}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        (
            chat_grammar(None, tools, "required", tokenizer, model.tool_format)[0],
            tokenizer.encode(  # as gpt-oss writes a call (its <|call|> is an end token)
                '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
            ),
        ),
        (
            chat_grammar(
                {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                None,
                None,
                tokenizer,
                model.tool_format,
            )[0],
            reply(assistant('{"a": 1}', "final"))[:-1],
        ),
    ]
    for grammar, tokens in cases:
        matcher = compiler.matcher(grammar)
        for token in tokens:
            assert compiler.allowed(matcher)[token], tokenizer.decode([token], False)
            matcher.consume_token(token)
        assert matcher.is_accepting()


def test_a_responses_round_trip_keeps_the_turn_s_analysis_by_its_items_or_the_store():
    """The output items sent back, or previous_response_id, then the call's output: the prompt is
    openai-harmony's with the turn's analysis kept, as in chat."""
    from services.gateway.api.response_store import ResponseStore
    from services.gateway.api.responses_api import (
        Responses,
        ResponsesBody,
        ResponsesCall,
        input_messages,
    )
    from services.gateway.prepare.requests import Prepared

    model, tools = served_model(), [{"type": "function", "function": WEATHER}]
    asked = CONVERSATION[:2]
    responses = _surface(Responses)
    responses.store = ResponseStore(10, 60)
    replied = events(reply(*CALL_REPLY), 3)

    async def stream():
        for event in replied:
            yield event

    async def run(response_id: str, streamed: bool) -> list[dict]:
        call = ResponsesCall(ResponsesBody(input=asked), asked, response_id)
        prepared = Prepared(response_id, [None], 1, chat=True)
        if not streamed:
            return (await responses.unary(prepared, call, stream()))["output"]
        chunks = [e async for e in responses.chunks(prepared, call, stream())]
        return chunks[-1]["response"]["output"]

    thought, arguments = "The user wants the weather, é 😀.", '{"city": "Paris"}'
    result = weather_result()
    history = [
        assistant(thought, "analysis"),
        assistant("Checking the weather.", "commentary"),
        call(arguments),
        result,
    ]
    for response_id, streamed in (("resp_1", False), ("resp_2", True)):
        output = asyncio.run(run(response_id, streamed))
        answer = [
            {
                "type": "function_call_output",
                "call_id": output[-1]["call_id"],
                "output": "sunny, 21 C",
            }
        ]
        for messages in (
            input_messages(asked + output + answer),
            responses.store.get(response_id) + input_messages(answer),
        ):
            request = ChatRequest(messages, SamplingOptions(), tools=tools)
            assert requests.chat_prompt(request, model) == reference(
                ReasoningEffort.MEDIUM, history
            )
