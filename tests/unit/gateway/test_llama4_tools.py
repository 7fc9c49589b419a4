"""Llama 4 in the gateway: its JSON and pythonic tool calls give the same content and calls at
every split, their arguments streamed as a valid JSON prefix while the call is written, and come
back as tool_calls / function_call / tool_use, unary and streamed; each API's tool round trip
renders llama-models' own prompt ids; an image gets a 400 naming text-only serving."""

from __future__ import annotations

import json

import grpc
import pytest

from services.gateway.output.tool_calls import ToolCallParser
from services.gateway.output.tool_formats import FORMATS, detect
from services.gateway.output.tool_streams import ARGUMENTS, DONE, START, CallDelta
from tests.unit.gateway.test_tool_call_streaming import _events, _run, _surface, check_steps
from tests.unit.gateway.test_tool_calls import splits
from tests.unit.test_llama4_vocab import CONVERSATION, llama4_folder, published_template, reference

WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {})
TRANSCRIPTS = [
    ("llama4_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
    (  # as llama-models writes a past call, two after each other, inside python_start/end
        "llama4_json",
        'Checking.<|python_start|>{"type": "function", "name": "get_weather", "parameters": '
        '{"city": "Paris"}}{"name": "get_time", "parameters": {}}<|python_end|>',
        "Checking.",
        [WEATHER, TIME],
    ),
    (
        "llama4_json",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
        "",
        [WEATHER, TIME],
    ),
    ("llama4_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("llama4_pythonic", '[get_weather(city="Paris"), get_time()]', "", [WEATHER, TIME]),
    (
        "llama4_pythonic",
        "<|python_start|>[maps.route(start='Paris', stops=['Lyon', \"Nice\"], avoid=(1, -2.5), "
        'opts={"tolls": false, "ferry": None}, fast=True,)]<|python_end|>',
        "",
        [
            (
                "maps.route",
                {
                    "start": "Paris",
                    "stops": ["Lyon", "Nice"],
                    "avoid": [1, -2.5],
                    "opts": {"tolls": False, "ferry": None},
                    "fast": True,
                },
            )
        ],
    ),
    (  # escapes, a triple-quoted string, a raw one, two literals joined
        "llama4_pythonic",
        r'[note(text="caf\u00e9 \x41\101\N{BULLET} \"q\"\n", doc="""a "b" c""", pat=r"\d+", j="a" "b")]',
        "",
        [("note", {"text": 'café AA• "q"\n', "doc": 'a "b" c', "pat": "\\d+", "j": "ab"})],
    ),
    ("llama4_pythonic", "It is sunny in Paris.", "It is sunny in Paris.", []),
]


@pytest.mark.parametrize("fmt, text, content, calls", TRANSCRIPTS, ids=[t[0] for t in TRANSCRIPTS])
def test_each_split_gives_the_same_calls_and_deltas_joining_to_their_arguments(
    fmt, text, content, calls
):
    expected = None
    for pieces in splits(text):
        parser = ToolCallParser(FORMATS[fmt])
        parts = [p for piece in pieces for p in parser.read(piece)] + parser.read_end()
        got_content, got_calls, joined = check_steps(parts)
        assert got_content == content, pieces
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, pieces
        assert sorted(joined) == list(range(len(calls))), pieces
        expected = expected or [(c.name, c.arguments) for c in got_calls]
        assert [(c.name, c.arguments) for c in got_calls] == expected, pieces


@pytest.mark.parametrize("fmt", ["llama4_json", "llama4_pythonic"])
def test_arguments_stream_while_the_call_is_being_written(fmt):
    """A character at a time: the call is announced at its name, and a long string argument
    arrives in many deltas before the output ends."""
    city = "Llanfairpwllgwyngyll, Wales"
    text = (
        f'{{"name": "get_weather", "parameters": {{"city": "{city}"}}}}'
        if fmt == "llama4_json"
        else f'[get_weather(city="{city}")]'
    )
    parser = ToolCallParser(FORMATS[fmt])
    steps = [(i, p) for i, ch in enumerate(text) for p in parser.read(ch)]
    steps += [(len(text), p) for p in parser.read_end()]
    kinds = [(i, p.kind) for i, p in steps if isinstance(p, CallDelta)]
    start = next(i for i, k in kinds if k == START)
    assert start < text.index(city)
    assert len([k for i, k in kinds if k == ARGUMENTS and i < len(text)]) > len(city) // 2
    assert check_steps([p for _, p in steps])[2] == {0: json.dumps({"city": city})}


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("llama4_pythonic", "[get_weather('Paris')]"),  # positional
        ("llama4_pythonic", "[get_weather(city=nan)]"),
        ("llama4_pythonic", "[get_weather(city=city_name)]"),
        ("llama4_pythonic", '[get_weather(city="Paris")] and more'),
        ("llama4_pythonic", '[get_weather(city="Par'),
        ("llama4_pythonic", "[1, 2, 3] are numbers"),
        ("llama4_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and more'),
        ("llama4_json", '<|python_start|>{"name": "get_weather", "parameters": {"city": '),
    ],
)
def test_what_is_not_a_call_comes_back_as_the_text_it_was(fmt, text):
    for pieces in splits(text):
        parser = ToolCallParser(FORMATS[fmt])
        parts = [p for piece in pieces for p in parser.read(piece)] + parser.read_end()
        content, calls, _ = check_steps(parts)
        assert calls == [] and content == text, pieces
        assert all(p.kind != DONE for p in parts if isinstance(p, CallDelta))


def test_llama4_markup_is_detected_from_the_template_and_model_type():
    from engine.llama4_vocab import chat_template

    assert detect(chat_template()).name == "llama4_json"
    assert detect(published_template()).name == "llama4_json"
    assert detect(None, "llama4_text").name == "llama4_json"
    pythonic = "<|header_start|>system<|header_end|>\n\n[func_name1(params_name1=params_value1)]"
    assert detect(pythonic).name == "llama4_pythonic"
    assert detect(chat_template(), "", "llama4_pythonic").name == "llama4_pythonic"


JSON_CALLS = (
    '<|python_start|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
    '{"name": "get_time", "parameters": {"zone": "CET"}}<|python_end|>'
)
PYTHONIC_CALLS = '[get_weather(city="Paris"), get_time(zone="CET")]'
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


def _pieces(text: str) -> list[str]:
    return [text[i : i + 3] for i in range(0, len(text), 3)]


@pytest.mark.parametrize(
    "fmt, text", [("llama4_json", JSON_CALLS), ("llama4_pythonic", PYTHONIC_CALLS)]
)
def test_calls_come_back_in_each_api_unary_and_streamed(fmt, text):
    from services.gateway.api.messages_api import Messages
    from services.gateway.api.openai_api import ChatCompletions
    from services.gateway.api.openai_models import ChatCompletionBody
    from services.gateway.api.response_store import ResponseStore
    from services.gateway.api.responses_api import Responses, ResponsesBody, ResponsesCall
    from services.gateway.prepare.requests import Prepared

    events = _events(fmt, _pieces(text))
    body = ChatCompletionBody(messages=[{"role": "user", "content": "hi"}], stream=True)
    unary, chunks = _run(
        _surface(ChatCompletions), Prepared("chatcmpl-1", [None], 1, chat=True), body, events
    )
    message = unary["choices"][0]["message"]
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ] == CALLS
    streamed: dict[int, list] = {}
    for chunk in chunks:
        for entry in chunk["choices"][0]["delta"].get("tool_calls", []):
            got = streamed.setdefault(entry["index"], [entry["function"].get("name"), ""])
            got[1] += entry["function"]["arguments"]
    assert [(n, json.loads(a)) for n, a in streamed.values()] == CALLS
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not message["content"]

    surface = _surface(Responses)
    surface.store = ResponseStore(10, 60)
    call = ResponsesCall(ResponsesBody(input="hi"), [{"role": "user", "content": "hi"}], "resp_1")
    unary, streamed_events = _run(surface, Prepared("resp-1", [None], 1, chat=True), call, events)
    final = streamed_events[-1]["response"]["output"]
    for output in (unary["output"], final):
        assert [
            (i["name"], json.loads(i["arguments"])) for i in output if i["type"] == "function_call"
        ] == CALLS

    unary, streamed_events = _run(
        _surface(Messages), Prepared("msg-1", [None], 1, chat=True), None, events
    )
    assert unary["stop_reason"] == "tool_use"
    assert [(b["name"], b["input"]) for b in unary["content"] if b["type"] == "tool_use"] == CALLS
    inputs: dict[int, str] = {}
    for e in streamed_events:
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
            inputs[e["index"]] = inputs.get(e["index"], "") + e["delta"]["partial_json"]
    assert [json.loads(v) for v in inputs.values()] == [c[1] for c in CALLS]


@pytest.fixture(scope="module")
def llama4_surfaces(tmp_path_factory):
    """The three APIs over a Llama 4 model with no tokenizer files (llama-models' vocabulary,
    tandem's template)."""
    from engine.tokenizer import Tokenizer
    from services.gateway.api.messages_api import Messages
    from services.gateway.api.openai_api import ChatCompletions
    from services.gateway.api.response_store import ResponseStore
    from services.gateway.api.responses_api import Responses
    from services.gateway.prepare.requests import ServedModel

    tokenizer = Tokenizer(llama4_folder(tmp_path_factory.mktemp("llama4")))
    model = ServedModel(
        "llama4", tokenizer, 8192, 202048, detect(tokenizer.chat_template, "llama4")
    )
    frontend = type("F", (), {"prices": None, "model": model})()
    surfaces = {}
    for name, cls in (("chat", ChatCompletions), ("responses", Responses), ("messages", Messages)):
        surface = cls.__new__(cls)
        surface.frontend = frontend
        surface.store = ResponseStore(10, 60)
        surfaces[name] = surface
    return surfaces


def _prompt(surface, body: dict) -> list[int]:
    return (
        surface.prepare(surface.parse({"model": "llama4", **body}), "")
        .generations[0]
        .prompt_token_ids
    )


def test_each_api_s_tool_round_trip_renders_llama_models_prompt(llama4_surfaces):
    system, user, assistant, tool = CONVERSATION[:4]
    call = assistant["tool_calls"][0]
    expected = reference(CONVERSATION[:4])
    chat = _prompt(llama4_surfaces["chat"], {"messages": CONVERSATION[:4], "max_tokens": 8})
    responses = _prompt(
        llama4_surfaces["responses"],
        {
            "instructions": system["content"],
            "input": [
                {"role": "user", "content": user["content"]},
                {
                    "type": "function_call",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                },
                {"type": "function_call_output", "call_id": call["id"], "output": tool["content"]},
            ],
        },
    )
    messages = _prompt(
        llama4_surfaces["messages"],
        {
            "system": system["content"],
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": user["content"]},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": call["id"],
                            "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"]),
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": call["id"],
                            "content": tool["content"],
                        }
                    ],
                },
            ],
        },
    )
    assert chat == responses == messages == expected


IMAGE = "data:image/png;base64,iVBORw0KGgo="


@pytest.mark.parametrize(
    "api, body",
    [
        (
            "chat",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": IMAGE}},
                        ],
                    }
                ]
            },
        ),
        (
            "responses",
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE}]}]},
        ),
        (
            "messages",
            {
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "iVBO",
                                },
                            }
                        ],
                    }
                ],
            },
        ),
    ],
)
def test_an_image_to_llama4_gets_a_400_saying_text_only(llama4_surfaces, api, body):
    from services.gateway.errors import GatewayError

    surface = llama4_surfaces[api]
    with pytest.raises(GatewayError) as refused:
        surface.prepare(surface.parse({"model": "llama4", **body}), "")
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    response = surface.error_response(refused.value)
    assert response.status_code == 400
    message = json.loads(response.body)["error"]["message"]
    assert "content is not supported: tandem serves text only" in message, message
    assert "vision" in message


def test_a_forced_call_is_written_as_llama4_json_and_parses_back(llama4_surfaces):
    """tool_choice "required" on Llama 4's own vocabulary (its tiktoken encoding)."""
    from llguidance import LLMatcher

    from engine.grammar import GrammarCompiler
    from services.gateway.prepare.structured import tool_call_grammar

    tokenizer = llama4_surfaces["chat"].model.tokenizer
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    grammar, used = tool_call_grammar(tools, "required", tokenizer, FORMATS["llama4_json"])
    assert used.name == "llama4_json"
    compiler = GrammarCompiler(tokenizer, list(tokenizer.eos_token_ids), tokenizer.vocab_size)
    matcher = LLMatcher(compiler.tokenizer, grammar)
    forced = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert all(matcher.consume_token(t) for t in tokenizer.encode(forced))
    assert matcher.is_accepting()
    parser = ToolCallParser(used)
    assert [
        (c.name, json.loads(c.arguments)) for c in parser.feed(forced)[1] + parser.finish()[1]
    ] == [WEATHER]
