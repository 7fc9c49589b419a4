"""A tokenizer only the checkpoint's own Python reads (tokenizer_config.json's auto_map, no
tokenizer.json, no tiktoken.model) is refused, naming its file and the flag, unless
--trust-remote-code is given; then transformers loads it. The native readers stay first."""

from __future__ import annotations

import json

import pytest

from engine.errors import CheckpointError
from engine.tokenizer import Tokenizer, has_tokenizer

# A character-level tokenizer class, as a checkpoint would ship it beside its weights.
TOKENIZATION_TINY = """
import json
import os

from transformers import PreTrainedTokenizer


class TinyTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiny_vocab.json"}
    model_input_names = ["input_ids"]

    def __init__(self, vocab_file, **kwargs):
        with open(vocab_file) as f:
            self.vocab = json.load(f)
        self.ids = {i: c for c, i in self.vocab.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.vocab)

    def get_vocab(self):
        return {**self.vocab, **self.added_tokens_encoder}

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.vocab.get(token, self.vocab["?"])

    def _convert_id_to_token(self, index):
        return self.ids.get(index, "?")

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return (os.path.join(save_directory, "tiny_vocab.json"),)
"""
CHARS = "?abcdefghijklmnopqrstuvwxyz ,.!"


@pytest.fixture
def remote_folder(tmp_path):
    (tmp_path / "tokenization_tiny.py").write_text(TOKENIZATION_TINY)
    (tmp_path / "tiny_vocab.json").write_text(json.dumps({c: i for i, c in enumerate(CHARS)}))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "auto_map": {"AutoTokenizer": ["tokenization_tiny.TinyTokenizer", None]},
                "tokenizer_class": "TinyTokenizer",
                "eos_token": "</s>",
                "added_tokens_decoder": {str(len(CHARS)): {"content": "</s>", "special": True}},
                "chat_template": "{% for m in messages %}{{ m.content }}</s>{% endfor %}",
            }
        )
    )
    return tmp_path


def test_without_the_flag_the_refusal_names_the_file_and_the_flag(remote_folder):
    assert not has_tokenizer(str(remote_folder))
    with pytest.raises(CheckpointError, match=r"tokenization_tiny\.py.*pass --trust-remote-code"):
        Tokenizer(str(remote_folder))


def test_with_the_flag_transformers_loads_the_checkpoint_s_own_tokenizer(remote_folder):
    assert has_tokenizer(str(remote_folder), trust_remote_code=True)
    tokenizer = Tokenizer(str(remote_folder), trust_remote_code=True)
    ids = tokenizer.encode("hi, tandem!")
    assert ids == [CHARS.index(c) for c in "hi, tandem!"]
    assert tokenizer.decode(ids) == "hi, tandem!"
    eos = len(CHARS)
    assert tokenizer.eos_token_ids == (eos,) and tokenizer.vocab_size == len(CHARS) + 1
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "ab"}])
    assert tokenizer.encode(prompt) == [1, 2, eos]  # the special token is one id
    assert (
        tokenizer.decode([1, eos]) == "a"
        and tokenizer.decode([1, eos], skip_special_tokens=False) == "a</s>"
    )


def test_native_files_stay_the_default_even_with_the_flag(remote_folder, chat_checkpoint):
    """With tokenizer.json beside it, the checkpoint's code is never run, flag or not."""
    (remote_folder / "tokenization_tiny.py").write_text(
        "raise RuntimeError('the checkpoint code ran')\n"
    )
    (remote_folder / "tokenizer.json").write_text((chat_checkpoint / "tokenizer.json").read_text())
    tokenizer = Tokenizer(str(remote_folder), trust_remote_code=True)
    assert tokenizer.tokenizer_json == str(remote_folder / "tokenizer.json")
    assert tokenizer.encode("hello") == Tokenizer(str(chat_checkpoint)).encode("hello")


def test_the_gateway_and_make_run_take_the_flag(remote_folder, monkeypatch):
    import argparse

    from services import settings
    from services.gateway.config import GatewayConfig

    with pytest.raises(ValueError, match="pass --trust-remote-code"):
        GatewayConfig(model=str(remote_folder), workers=("127.0.0.1:1",))
    assert GatewayConfig(model=str(remote_folder), workers=("127.0.0.1:1",), trust_remote_code=True)
    monkeypatch.setenv("TANDEM_TRUST_REMOTE_CODE", "1")
    parser = argparse.ArgumentParser()
    settings.add_flags(parser, GatewayConfig)
    assert parser.parse_args(["--model", "m"]).trust_remote_code is True
    assert parser.parse_args(["--model", "m", "--no-trust-remote-code"]).trust_remote_code is False


def test_a_worker_given_the_flag_reads_it_too(remote_folder, chat_checkpoint):
    """The engine needs the tokenizer for stop strings and structured outputs."""
    import shutil

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    for name in ("config.json", "model.safetensors"):
        shutil.copy(chat_checkpoint / name, remote_folder / name)
    assert (
        LLMEngine(EngineConfig(model=str(remote_folder), kv_cache_bytes=1 << 20)).tokenizer is None
    )
    engine = LLMEngine(
        EngineConfig(model=str(remote_folder), kv_cache_bytes=1 << 20, trust_remote_code=True)
    )
    assert engine.tokenizer.encode("ab") == [1, 2]
