"""Structured outputs in the engine: a random model's replies under a JSON schema parse and
follow it, a bad grammar is refused, and speculation (prompt lookup, wrong drafts) changes
nothing: the same replies token for token, drafts cut to what the grammar accepts."""

from __future__ import annotations

import json
import os

import pytest
from llguidance import LLMatcher

from engine.config import EngineConfig, ModelConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative.ngram import NgramDrafter
from tests.unit.test_speculative import Noise

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 0, "maximum": 99},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
GRAMMAR = LLMatcher.grammar_from_json_schema(
    SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
)
PROMPTS = [[5, 6, 7, 8], list(range(20, 40)), [11, 12, 13] * 5]


@pytest.fixture(scope="module")
def checkpoint():
    """The demo model: its tokenizer's end token is its config's (the tiny test model's is not)."""
    return os.path.join(os.path.dirname(__file__), "..", "..", "demo", "tandem-demo")


def engine_with(checkpoint, drafter=None) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint, dtype="float32", kv_cache_bytes=4 << 20, num_speculative_tokens=4
        )
    )
    engine.speculator.drafter = drafter
    engine.speculator.tuner.choose = lambda batch_size: 4  # verify drafts every step
    return engine


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_replies_follow_the_schema_and_speculation_changes_nothing(checkpoint, temperature):
    params = SamplingParams(max_tokens=80, temperature=temperature, seed=7, grammar=GRAMMAR)
    engine = engine_with(checkpoint)
    plain = engine.generate(PROMPTS, params)
    for reply in plain:
        assert reply.finish_reason == "stop" and reply.token_ids[-1] in engine.eos_token_ids
        text = engine.tokenizer.decode(reply.token_ids, skip_special_tokens=True)
        value = json.loads(text)
        assert (
            set(value) == {"city", "days", "sunny"}
            and isinstance(value["days"], int)
            and 0 <= value["days"] <= 99
        )
        assert isinstance(value["sunny"], bool) and len(value["city"]) <= 12
    for drafter in (
        NgramDrafter(),
        Noise(vocab_size=ModelConfig.from_folder(checkpoint).vocab_size),
    ):
        engine = engine_with(checkpoint, drafter)
        assert [r.token_ids for r in engine.generate(PROMPTS, params)] == [
            r.token_ids for r in plain
        ]
        assert engine.num_free_blocks == engine.num_blocks


def test_a_bad_grammar_is_refused_and_nothing_is_left(checkpoint):
    engine = engine_with(checkpoint)
    with pytest.raises(InvalidRequestError, match="grammar"):
        engine.add_request(
            "bad", [5, 6], SamplingParams(grammar='{"grammars": [{"lark_grammar": "start: ("}]}')
        )
    assert not engine.seqs and not engine.has_unfinished_requests()


def test_masking_drafts_that_end_the_reply_leaves_the_grammar_where_it_was(checkpoint):
    """A draft that closes the JSON and ends (the end token: llguidance cannot roll it back)."""
    engine = engine_with(checkpoint)
    compiler, tok = engine._grammar_compiler(), engine.tokenizer
    matcher = compiler.matcher(GRAMMAR)
    for token in tok.encode('{"city": "x", "days": 3, "sunny": ', add_special_tokens=False):
        assert matcher.consume_token(token)
    before = compiler.allowed(matcher)
    draft = tok.encode("true}", add_special_tokens=False) + [sorted(engine.eos_token_ids)[0]]
    masks = compiler.masks(matcher, draft)
    # the end is allowed there
    assert masks.shape[0] == len(draft) + 1 and masks[len(draft) - 1, draft[-1]]
    assert (compiler.allowed(matcher) == before).all() and not before[draft[-1]]
    assert matcher.consume_tokens(tok.encode("false}", add_special_tokens=False))


def test_a_tiktoken_vocabulary_constrains_too(hf_checkpoint, tmp_path):
    """Kimi's tiktoken.model (no tokenizer.json): llguidance reads the encoding itself."""
    import shutil

    from tests.tiny_models import kimi_tokenizer

    folder = tmp_path / "kimi"
    shutil.copytree(hf_checkpoint("kimi_k25")[1], folder)
    kimi_tokenizer(folder)
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="float32", kv_cache_bytes=4 << 20))
    [reply] = engine.generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=80, temperature=1.0, seed=3, grammar=GRAMMAR)
    )
    assert reply.finish_reason == "stop"
    value = json.loads(engine.tokenizer.decode(reply.token_ids, skip_special_tokens=True))
    assert set(value) == {"city", "days", "sunny"} and isinstance(value["days"], int)


def test_a_name_space_token_is_the_space_it_decodes_to(tmp_path):
    """The demo tokenizer's NAME_SPACE (demo/train.py) decodes to a space: the grammar reads it
    so, allowing it inside a name the grammar spells ("Hong Kong") and refusing it where a
    space is refused."""
    from types import SimpleNamespace

    from demo.train import train_tokenizer
    from engine.grammar import GrammarCompiler, decoder_replacements

    texts = ['I live in Hong Kong, "city": "Hong Kong" and "Dar es Salaam" today'] * 50
    tok = train_tokenizer(texts, 300, name_spaces=True)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert decoder_replacements(json.loads(path.read_text())) == [("\u2581".encode(), b" ")]
    plain = tmp_path / "plain.json"
    train_tokenizer(texts, 300).save(str(plain))
    assert decoder_replacements(json.loads(plain.read_text())) == []

    vocab = tok.get_vocab_size(with_added_tokens=True)
    model_tokenizer = SimpleNamespace(  # engine/tokenizer.py's, as GrammarCompiler reads it
        tokenizer_json=str(path),
        encode=lambda text, add_special_tokens: tok.encode(text, add_special_tokens).ids,
    )
    compiler = GrammarCompiler(model_tokenizer, [2], vocab)
    ids = tok.encode('{"city":"Hong Kong"}').ids
    name_space = tok.token_to_id("\u00e2\u0138\u0123")  # U+2581's bytes, byte-level spelled
    assert name_space in ids
    for schema, accepted in (
        ({"enum": ["Hong Kong"]}, len(ids)),
        ({"type": "string", "pattern": "^\\S+$"}, ids.index(name_space)),
    ):
        grammar = LLMatcher.grammar_from_json_schema(
            {"type": "object", "properties": {"city": schema}, "required": ["city"]},
            defaults={"whitespace_flexible": False},
        )
        assert compiler.matcher(grammar).validate_tokens(ids) == accepted
