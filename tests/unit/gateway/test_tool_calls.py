"""Tool-call parsing from streamed text: each family's markup (golden transcripts in the forms
their chat templates and documentation give), fed whole, character by character, at every
split point and in random cuts, gives the same content and calls."""

from __future__ import annotations

import json

import pytest

from services.gateway.output.tool_calls import ToolCallParser
from services.gateway.output.tool_formats import FORMATS, detect

TEXT = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> Done.'


def run(parser: ToolCallParser, pieces: list[str]):
    content, calls = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content += text
        calls += new
    rest, last = parser.finish()
    return content + rest, calls + last


@pytest.mark.parametrize("size", [1, 3, 7, len(TEXT)])
def test_tool_call_is_parsed_whatever_the_chunking(size):
    content, calls = run(ToolCallParser(), [TEXT[i : i + size] for i in range(0, len(TEXT), size)])
    assert content == "Let me check.  Done."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_")


def test_text_resembling_a_tag_is_shown_once_it_is_not_one():
    parser = ToolCallParser()
    assert parser.feed("a <tool") == ("a ", [])
    assert parser.feed("box> b") == ("<toolbox> b", [])


def test_invalid_json_and_unclosed_calls_come_back_as_text():
    content, calls = run(
        ToolCallParser(), ['<tool_call>{not json}</tool_call> and <tool_call>{"name": "x"']
    )
    assert calls == []
    assert content == '<tool_call>{not json}</tool_call> and <tool_call>{"name": "x"'


def test_two_calls_and_string_encoded_arguments():
    text = (
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = run(ToolCallParser(), [text])
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("get_time", {}),
    ]


WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {})
TRANSCRIPTS = [
    (
        "hermes",
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "Let me check. ",
        [WEATHER],
    ),
    (
        "qwen3_coder",
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "Sure.\n",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [WEATHER]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
        [WEATHER, TIME],
    ),
    ("llama3_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    (
        "mistral",
        'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Checking.",
        [WEATHER, TIME],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [WEATHER, TIME],
    ),
    (
        "deepseek_v3",
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Let me look.",
        [WEATHER],
    ),
    (
        "deepseek_v31",
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
        "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>",
        "",
        [WEATHER, TIME],
    ),
    (
        "kimi_k2",
        "I will check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        "I will check.",
        [WEATHER, TIME],
    ),
]


def splits(text: str):
    import random

    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("fmt, text, content, calls", TRANSCRIPTS, ids=[t[0] for t in TRANSCRIPTS])
def test_each_family_s_markup_gives_the_same_calls_however_it_streams(fmt, text, content, calls):
    for pieces in splits(text):
        got_content, got_calls = run(ToolCallParser(FORMATS[fmt]), pieces)
        assert got_content == content, pieces
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls, pieces
    if fmt == "kimi_k2":  # Kimi's own ids, as its template shows them
        assert [c.id for c in got_calls] == ["functions.get_weather:0", "functions.get_time:1"]


@pytest.mark.parametrize(
    "fmt, text",
    [
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{bad"
            "<|tool_call_end|><|tool_calls_section_end|>",
        ),
        ("mistral", "[TOOL_CALLS][{not json"),
        ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"),
        ("llama3_json", '{"name": "f", "parameters": '),
    ],
)
def test_malformed_calls_in_every_format_come_back_as_text(fmt, text):
    content, calls = run(ToolCallParser(FORMATS[fmt]), [text])
    assert calls == [] and content == text


@pytest.mark.parametrize(
    "template, model_type, name",
    [
        ("{{ '<|tool_calls_section_begin|>' }}", "", "kimi_k2"),
        ("", "kimi_k2", "kimi_k2"),
        (
            "<｜tool▁calls▁begin｜>{{ tool['type'] }}<｜tool▁sep｜>{{ name }}\n```json\n",
            "",
            "deepseek_v3",
        ),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{{ name }}<｜tool▁sep｜>", "", "deepseek_v31"),
        ("<tool_call>\n<function={{ name }}>\n<parameter={{ p }}>", "", "qwen3_coder"),
        ("[TOOL_CALLS]", "", "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|>", "", "llama3_json"),
        ("<tool_call>{{ call | tojson }}</tool_call>", "", "hermes"),
        (None, "", "hermes"),
    ],
)
def test_the_format_is_detected_from_the_template_and_model_type(template, model_type, name):
    assert detect(template, model_type).name == name
    assert detect(template, model_type, "mistral").name == "mistral"  # --tool-call-parser overrides
    with pytest.raises(ValueError, match="unknown tool-call parser 'x'"):
        detect(template, model_type, "x")


FORCED = {  # one call of get_weather, as each format forces it (structured.py) and writes it
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:2<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    "deepseek_v31": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
}


@pytest.mark.parametrize("fmt", list(FORCED))
def test_a_forced_call_is_constrained_to_the_family_s_markup_and_parses_back(fmt, tmp_path):
    """tool_choice "required": the grammar accepts the call as the family writes it (Kimi's id
    numbered after the conversation's two earlier calls), and that parser reads it back;
    formats that cannot be forced (qwen3_coder, mistral) fall back to hermes."""
    from llguidance import LLMatcher

    from engine.grammar import GrammarCompiler
    from engine.tokenizer import Tokenizer
    from services.gateway.prepare.structured import tool_call_grammar
    from tests.tiny_models import kimi_tokenizer

    vocab = kimi_tokenizer(tmp_path)
    tokenizer = Tokenizer(str(tmp_path))
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    ]
    grammar, used = tool_call_grammar(tools, "required", tokenizer, FORMATS[fmt], call_index=2)
    assert used.name == fmt
    matcher = LLMatcher(
        GrammarCompiler(tokenizer, list(tokenizer.eos_token_ids), vocab).tokenizer, grammar
    )
    for token in tokenizer.encode(FORCED[fmt]):
        assert matcher.consume_token(token), (
            fmt,
            tokenizer.decode([token], skip_special_tokens=False),
        )
    assert matcher.is_accepting()
    content, calls = run(ToolCallParser(used), [FORCED[fmt]])
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [WEATHER]
    for other in ("qwen3_coder", "mistral"):
        assert tool_call_grammar(tools, "required", tokenizer, FORMATS[other])[1].name == "hermes"


def test_markup_that_is_special_tokens_reaches_the_parser_and_other_specials_do_not(
    chat_checkpoint, tmp_path
):
    """Mistral's [TOOL_CALLS] and [ARGS] are control tokens, which decoding skips: the stream
    keeps exactly the format's own, so the call is found, and the end token stays hidden."""
    import asyncio
    import shutil

    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from engine.tokenizer import Tokenizer
    from services.gateway.output.generation import generation_events
    from services.gateway.protocol import Delta, GenerationRequest, SamplingOptions
    from tests.unit.gateway.test_reasoning import ScriptedPool

    folder = tmp_path / "m"
    shutil.copytree(chat_checkpoint, folder)
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    hf.add_special_tokens(
        [AddedToken("[TOOL_CALLS]", special=True), AddedToken("[ARGS]", special=True)]
    )
    hf.save(str(folder / "tokenizer.json"))
    tokenizer = Tokenizer(str(folder))
    reply = tokenizer.encode('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>')
    # what plain decoding would show
    assert tokenizer.decode(reply) == 'get_weather{"city": "Paris"}'

    async def events(fmt):
        request = GenerationRequest("r", [5, 6], SamplingOptions(max_tokens=50))
        chunks = ScriptedPool([[t] for t in reply]).generate(request)
        return [e async for e in generation_events(chunks, tokenizer, request, 0, fmt, 0.0)]

    deltas = [e for e in asyncio.run(events(FORMATS["mistral"])) if isinstance(e, Delta)]
    assert "".join(d.text for d in deltas) == ""
    assert [(c.name, json.loads(c.arguments)) for d in deltas for c in d.tool_calls] == [WEATHER]


def test_mistral_calls_get_the_nine_character_ids_its_templates_demand_and_longer_ids_are_cut():
    from services.gateway.output.tool_formats import mistral_conversation

    for text in (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    ):
        _, [call] = run(ToolCallParser(FORMATS["mistral"]), [text])
        assert len(call.id) == 9 and call.id.isalnum()
    history = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0123456789abcdef",
                    "type": "function",
                    "function": {"name": "f", "arguments": {}},
                },
                {"id": "a1B2c3D4e", "type": "function", "function": {"name": "g", "arguments": {}}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "ok"},
    ]
    messages, tools = mistral_conversation(history, None)
    assert [c["id"] for c in messages[0]["tool_calls"]] == ["789abcdef", "a1B2c3D4e"]
    assert (
        messages[1]["tool_call_id"] == "789abcdef"
        and history[1]["tool_call_id"] == "call_0123456789abcdef"
    )
