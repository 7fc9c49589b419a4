"""Llama 4's tokenizer and chat format from the llama-models package: the special tokens at
llama-models' ids, its encoding, a folder without tokenizer files read with them and tandem's
template, whose prompt ids equal llama-models' ChatFormat.encode_dialog_prompt for a tool round
trip; a published folder's template read first and rendered as transformers renders it; the
vocabulary loaded with the network cut."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import types

import pytest

from engine import llama4_vocab
from engine.tokenizer import Tokenizer, has_tokenizer
from services.gateway.prepare.chat import normalize_messages, render_prompt

TEXT = "Café 😀 in Zürich costs 4.50€; naïve code: def f(x):\n\treturn x**2  # done\n\n"
NESTED = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "text_config": {"model_type": "llama4_text", "vocab_size": 202048},
}
TEXT_ONLY = {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text"}
ARGUMENTS = {"city": "Paris", "note": "près de la Seine"}
# a tool round trip in chat's messages, and the same as llama-models' RawMessages (reference())
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 21 °C and clear."},
    {"role": "user", "content": "And tomorrow?"},
]


def reference(messages: list[dict]) -> list[int]:
    """llama-models' own rendering (ChatFormat.encode_dialog_prompt, its JSON tool format)."""
    # chat_format imports its image transforms, which need torchvision (not installed, not
    # used for text): they are stood in for.
    stub = types.ModuleType("llama_models.llama4.preprocess")
    stub.ResizeNormalizeImageTransform = stub.VariableSizeImageTransform = None
    sys.modules.setdefault("llama_models.llama4.preprocess", stub)
    from llama_models.datatypes import RawMessage, ToolCall
    from llama_models.llama4.chat_format import ChatFormat
    from llama_models.llama4.tokenizer import Tokenizer as MetaTokenizer

    raw = []
    for m in messages:
        calls = [
            ToolCall(
                call_id=c["id"],
                tool_name=c["function"]["name"],
                arguments=json.loads(c["function"]["arguments"]),
            )
            for c in m.get("tool_calls", [])
        ]
        raw.append(RawMessage(role=m["role"], content=m["content"], tool_calls=calls))
    return ChatFormat(MetaTokenizer.get_instance()).encode_dialog_prompt(raw).tokens


def published_template() -> str:
    """Meta's published Llama 4 template, as transformers ships it (processing_llama4.py's
    chat_template, read from its source: importing it would import torch)."""
    spec = importlib.util.find_spec("transformers")
    path = os.path.join(
        spec.submodule_search_locations[0], "models", "llama4", "processing_llama4.py"
    )
    with open(path) as f:
        tree = ast.parse(f.read())
    return next(
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "chat_template"
    )


def llama4_folder(path, config: dict = NESTED, template: str | None = None) -> str:
    """A Llama 4 checkpoint's folder with no tokenizer files (`template`: a tokenizer_config.json
    carrying it, as published)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if template is not None:
        (path / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "chat_template": template,
                    "bos_token": "<|begin_of_text|>",
                    "eos_token": "<|eot|>",
                }
            )
        )
    return str(path)


def test_the_special_tokens_and_the_encoding_are_llama_models_own():
    from llama_models.llama4.tokenizer import Tokenizer as MetaTokenizer

    meta = MetaTokenizer.get_instance()
    assert llama4_vocab.SPECIAL_TOKENS == meta.special_tokens
    named = ["<|begin_of_text|>", "<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>"]
    named += ["<|python_start|>", "<|python_end|>", "<|image|>", "<|reserved_special_token_903|>"]
    assert [llama4_vocab.SPECIAL_TOKENS[t] for t in named] == [
        200000,
        200005,
        200006,
        200007,
        200008,
        200016,
        200017,
        200090,
        202047,
    ]
    assert llama4_vocab.EOS_TOKEN_IDS == tuple(meta.stop_tokens) == (200001, 200007, 200008)
    encoding = llama4_vocab.encoding()
    assert encoding.n_vocab == meta.n_words == llama4_vocab.VOCAB_SIZE == 202048
    text = TEXT + "<|header_start|>user<|header_end|>"
    assert encoding.encode(text, allowed_special="all") == meta.encode(
        text, bos=False, eos=False, allowed_special="all"
    )


@pytest.mark.parametrize("config", [NESTED, TEXT_ONLY], ids=["nested", "text-only"])
def test_a_llama4_folder_without_tokenizer_files_reads_the_package_vocabulary(tmp_path, config):
    folder = llama4_folder(tmp_path / "m", config)
    assert has_tokenizer(folder)
    tokenizer = Tokenizer(folder)
    assert tokenizer.vocab_size == 202048
    assert tokenizer.eos_token_ids == (200001, 200007, 200008)
    assert tokenizer.chat_template == llama4_vocab.chat_template()
    ids = tokenizer.encode(TEXT + "<|eot|>")
    assert ids[-1] == 200008 and tokenizer.decode(ids) == TEXT
    assert tokenizer.encode(TEXT, add_special_tokens=True) == [200000] + ids[:-1]
    assert tokenizer.token_to_id("<|python_start|>") == 200016
    assert tokenizer.special_markup(("<|python_start|>", "<|python_end|>")) == {200016, 200017}


def test_prompt_ids_equal_llama_models_rendering_of_a_tool_round_trip(tmp_path):
    tokenizer = Tokenizer(llama4_folder(tmp_path / "m"))
    for turns in (2, 4, 6):  # the call, its result, the turn after
        prompt = render_prompt(tokenizer, CONVERSATION[:turns], None)
        assert tokenizer.encode(prompt) == reference(CONVERSATION[:turns]), prompt


def test_a_published_template_is_read_first_and_rendered_as_transformers_renders_it(tmp_path):
    """Meta's template agrees with llama-models on plain turns; on tool turns it writes its own
    markup (engine/llama4_vocab.py says how), which tandem renders exactly as transformers does."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = published_template()
    tokenizer = Tokenizer(llama4_folder(tmp_path / "m", template=template))
    assert tokenizer.chat_template == template
    plain = [CONVERSATION[0], CONVERSATION[1], CONVERSATION[4], CONVERSATION[5]]
    assert tokenizer.encode(render_prompt(tokenizer, plain, None)) == reference(plain)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    (expected,), _ = render_jinja_template(
        [normalize_messages(CONVERSATION)],
        tools=tools,
        chat_template=template,
        add_generation_prompt=True,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot|>",
    )
    assert render_prompt(tokenizer, CONVERSATION, tools) == expected


def test_the_vocabulary_loads_with_the_network_cut(tmp_path):
    from tests.unit.test_o200k import _run_offline

    loaded = _run_offline(
        "import json, os, socket\n"
        "from engine.tokenizer import Tokenizer\n"
        f"os.makedirs({str(tmp_path / 'm')!r})\n"
        f"open({str(tmp_path / 'm' / 'config.json')!r}, 'w').write(json.dumps({NESTED!r}))\n"
        f"ids = Tokenizer({str(tmp_path / 'm')!r}).encode('hi <|eot|>')\n"
        "assert ids[-1] == 200008, ids\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 9))\n"
        "except OSError as exc:\n"
        "    print('loaded', ids, exc)\n",
        tmp_path,
    )
    assert loaded.returncode == 0 and "loaded" in loaded.stdout, loaded.stderr
    assert "network touched" in loaded.stdout  # the guard was live while it loaded
