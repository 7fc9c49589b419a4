"""Stop strings (which need the checkpoint's tokenizer) and the tokenizer/chat-template loader."""

from __future__ import annotations

import shutil

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


def test_stop_string_ends_generation_where_it_first_appears(chat_checkpoint):
    engine = LLMEngine(
        EngineConfig(model=str(chat_checkpoint), dtype="float32", kv_cache_bytes=8 << 20)
    )
    prompt = [5, 6, 7, 8]
    free = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[
        0
    ]
    text = engine.tokenizer.decode(free.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string, text was {text!r}"

    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: len(stopped.token_ids)]
    assert stop in engine.tokenizer.decode(stopped.token_ids)
    assert stop not in engine.tokenizer.decode(stopped.token_ids[:-1])


def test_tokenizer_reads_special_tokens_and_renders_the_chat_template(chat_checkpoint, tmp_path):
    assert Tokenizer(str(chat_checkpoint)).eos_token_ids == (2,)  # generation_config.json wins
    shutil.copytree(chat_checkpoint, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").unlink()
    tok = Tokenizer(str(tmp_path / "m"))
    assert tok.eos_token_ids == (1,)  # else the eos_token of tokenizer_config.json
    ids = tok.encode("the lazy dog", add_special_tokens=True)
    assert ids[0] == 0 and tok.decode(ids) == "the lazy dog"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=[{"name": "get_weather"}]
    )
    assert prompt == '<|user|>hi\n<|tools|>[{"name": "get_weather"}]\n<|assistant|>'


def test_a_tiktoken_vocabulary_reads_as_kimi_ships_it_without_its_code(tmp_path):
    """tiktoken.model and added_tokens_decoder (no tokenizer.json, no tokenization_kimi.py run):
    specials in the rendered template are one id each, eos ids from generation_config.json, and
    decoding skips the special tokens but keeps the tool-call markup (not special) for the parser."""
    from tests.tiny_models import KIMI_SPECIALS, kimi_tokenizer

    vocab = kimi_tokenizer(tmp_path)
    tok = Tokenizer(str(tmp_path))
    assert tok.vocab_size == vocab
    ids_of = {name: tok.token_to_id(name) for name in KIMI_SPECIALS}
    assert sorted(ids_of.values()) == list(range(vocab - 258, vocab - 258 + len(KIMI_SPECIALS)))
    assert tok.eos_token_ids == (ids_of["[EOS]"], ids_of["<|im_end|>"])
    prompt = tok.apply_chat_template([{"role": "user", "content": "the weather in paris?"}])
    ids = tok.encode(prompt)
    assert (
        ids[0] == ids_of["<|im_user|>"]
        and ids[-1] == ids_of["<|im_middle|>"]
        and ids_of["<|im_end|>"] in ids
    )
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    assert tok.decode(ids) == "userthe weather in paris?assistant"
    call = "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}"
    assert tok.decode(tok.encode(call + "<|im_end|>")) == call
    assert tok.token_to_id("<|reserved_token_557|>") == vocab - 1


def test_templates_as_models_ship_them(chat_checkpoint, tmp_path):
    """chat_template.jinja wins over tokenizer_config.json's; named templates pick `tool_use`
    when tools are given; Jinja's loop controls and transformers' helpers are there."""
    import json

    import pytest

    from engine.errors import CheckpointError

    folder = tmp_path / "m"
    shutil.copytree(chat_checkpoint, folder)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}[{{ m['content'] }}]"
        "{% if loop.index >= 2 %}{% break %}{% endif %}{% endfor %}"
        "{% if messages[-1]['content'] == 'bad' %}{{ raise_exception('no bad') }}{% endif %}"
    )
    tok = Tokenizer(str(folder))
    turns = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    assert tok.apply_chat_template(turns) == "[a]"
    with pytest.raises(Exception, match="no bad"):
        tok.apply_chat_template([{"role": "user", "content": "bad"}])
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "tools: {{ tools | tojson }}"},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(str(folder))
    assert tok.apply_chat_template(turns) == "plain"
    assert tok.apply_chat_template(turns, tools=[{"name": "f"}]) == 'tools: [{"name": "f"}]'
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no chat template"):
        Tokenizer(str(folder)).apply_chat_template(turns)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json or tiktoken.model"):
        Tokenizer(str(folder))
