"""Stop strings (which need the checkpoint's tokenizer) and the tokenizer/chat-template loader."""

from __future__ import annotations

import shutil

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

def test_stop_string_ends_generation_where_it_first_appears(chat_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(chat_checkpoint), dtype="float32", kv_cache_bytes=8 << 20))
    prompt = [5, 6, 7, 8]
    free = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    text = engine.tokenizer.decode(free.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string, text was {text!r}"

    stopped = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))[0]
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
