"""Incremental detokenization equals decoding everything at once, with no broken characters."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.gateway.output.detokenizer import REPLACEMENT, IncrementalDetokenizer

TEXT = 'Grüße aus Köln! 世界你好 🎉🚀 naïve café, {"city": "São Paulo"} done.'


class HFDecoder:
    def __init__(self, tok: Tokenizer):
        self.tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Few merges: multi-byte characters stay split across several byte tokens.
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    return tok


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_join_to_the_full_text_without_broken_characters(tokenizer, chunk):
    ids = tokenizer.encode(TEXT).ids
    detok = IncrementalDetokenizer(HFDecoder(tokenizer))
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert "".join(deltas) == TEXT
    assert not any(REPLACEMENT in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # some tokens only completed a character later


def test_flush_emits_a_dangling_partial_character(tokenizer):
    ids = tokenizer.encode("ab🎉").ids
    detok = IncrementalDetokenizer(HFDecoder(tokenizer))
    emitted = "".join(detok.add([i]) for i in ids[:-1])  # the emoji's last byte never arrives
    assert emitted == "ab"
    assert detok.flush().startswith(REPLACEMENT)
