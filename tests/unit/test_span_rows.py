"""demo/span_rows.py: the copy rows that teach the demo model where a copied name ends."""

from __future__ import annotations

import os
import random

import pytest
from tokenizers import Tokenizer

from demo.span_rows import PARTICLES, WIDTH, SpanPieces, span_batch
from demo.template import BOS, SPECIAL_TOKENS, TOOL_CALL_TOKENS
from deploy.processes import REPO_ROOT

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(os.path.join(REPO_ROOT, "demo", "tandem-demo", "tokenizer.json"))


def test_a_row_copies_the_name_after_in_and_closes_where_it_ends(tok):
    special = {tok.token_to_id(t) for t in SPECIAL_TOKENS + TOOL_CALL_TOKENS}
    pieces = SpanPieces(tok, special)
    bos = tok.token_to_id(BOS)
    ids, labels, mask = span_batch(pieces, 200, bos, random.Random(3))
    assert ids.shape == labels.shape == (200, WIDTH)
    endings, closes = set(), set()
    for row, label, m in zip(ids.tolist(), labels.tolist(), mask.tolist()):
        opening, close = next(q for q in pieces.quotes if row[-len(q[1]) :] == q[1])
        opened = len(row) - 1 - row[::-1].index(opening[-1])
        assert row[opened + 1 - len(opening) : opened + 1] == opening
        name = row[opened + 1 : -len(close)]
        at = next(
            i + len(intro)
            for intro in pieces.intros
            for i in range(len(row))
            if row[i : i + len(intro) + len(name)] == intro + name
        )
        copied, end = tok.decode(name), at + len(name)
        # the name ends at punctuation, or at a space and a lower-case word that is no particle
        if row[end : end + 1] == pieces.space:
            word = tok.decode(row[end + 1 : end + 2])
            assert word.islower() and word not in PARTICLES
            endings.add("word")
        else:
            assert tok.decode(row[end : end + 1])[0] in "?.,!"
            endings.add("punctuation")
        # inside the name, a space is followed by a capital or a particle
        assert copied[0].isupper()
        for word in copied.split(" ")[1:]:
            assert word[0].isupper() or word in PARTICLES
        # labelled: the copy after its first token (found by the word before it), and the close
        labelled = [t for t, lab in zip(row, label) if lab != -100]
        assert labelled == name[1:] + close
        closes.add(tuple(close))
        assert sum(m) == len(labelled)
    assert endings == {"word", "punctuation"}
    assert len(closes) == 2
