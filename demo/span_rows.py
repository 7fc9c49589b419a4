"""Copy rows that end: a made-up name in running text, then copied between quotes and closed.

demo/train.py's plain copy rows ("x x") teach the model to copy but never where to stop. With
spaces as tokens of their own, where a name ends is read two tokens ahead: after "Hong" the
prompt has a space both in "Hong Kong" and in "Florence today", and only the word after the
space says whether to go on. Runs 9-15 of demo/README.md copied as many words as their training
names had rather than read that word. These rows ask for exactly that decision, on random
pieces:

    [BOS] filler Ġ in Ġ <name> <end> filler {" query ": Ġ " <name> "}}    (or city ... ",)

A name is one to three words of letter pieces, each word starting with a capital (plain or
accented), sometimes joined by a lower-case particle ("de", "es", "von"): after a space, a
capital or a particle goes on. It ends at punctuation or at a space and a lower-case word that
is no particle ("today"). Labels on the copy after its first token (found by the word before
it) and on the close, the token a call has after that argument: `",` after a city (a unit
follows), `"}}` after a query (the arguments and the call end).

Runs 16-18 (demo/README.md) learned these rows (95-98% of held-out rows right) but not the
real calls' decision: a probe of the next token after "Hong" in '{"city": "Hong' gives the
space 0.11-0.14 for "Hong Kong" and 0.11-0.20 for "Denver today", and after a query's first
word 0.34-0.97 whatever follows: the models read the tool, not the word after the space.
(Run 16 closed with `"}` everywhere, run 17 with `"}` after a query; run 18 as here, with
--known-first, and the same: demo/README.md.)
"""

from __future__ import annotations

import random
import re

import torch

from demo.corpus import ACCENTS

PARTICLES = ["de", "es", "da", "do", "la", "del", "van", "von", "el", "du", "di", "dos"]
ENDS = ["?", ".", ",", "!", "?\n", "."]
WIDTH = 64


class SpanPieces:
    """Token ids the rows draw from, found in the tokenizer once."""

    def __init__(self, tok, special: set[int]):
        def ids(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False).ids

        letters = []
        for i in range(tok.get_vocab_size(with_added_tokens=True)):
            text = tok.decode([i])
            if i not in special and re.fullmatch(r"[^\W\d_]+", text) and text.isascii():
                letters.append((i, text))
        self.capitals = [[i] for i, t in letters if t[0].isupper()]
        self.capitals += [ids(ch) for ch in "".join(ACCENTS.values()).upper()]
        self.lower = [[i] for i, t in letters if t.islower()]
        self.lower_accented = [ids(ch) for ch in "".join(ACCENTS.values())]
        self.particles = [ids(p) for p in PARTICLES]
        self.tail_words = [[i] for i, t in letters if t.islower() and len(t) >= 3]
        self.tail_words = [w for w in self.tail_words if tok.decode(w) not in PARTICLES]
        self.ends = [ids(e) for e in ENDS]
        self.space = ids(" ")
        self.filler = [i for i, _ in letters] + self.space[:1] * (len(letters) // 9)
        self.intros = [ids(f" {w} ") for w in ("in", "for", "about", "up")]
        self.quotes = [(ids('{"city": "'), ids('",')), (ids('{"query": "'), ids('"}}'))]


def name(p: SpanPieces, rng: random.Random) -> list[int]:
    words = []
    for w in range(rng.randint(1, 3)):
        if w and rng.random() < 0.15:
            words.append(rng.choice(p.particles))
        word = list(rng.choice(p.capitals))
        for _ in range(rng.randint(0, 3)):
            pool = p.lower_accented if rng.random() < 0.1 else p.lower
            word += rng.choice(pool)
        words.append(word)
    out = words[0]
    for word in words[1:]:
        out = out + p.space + word
    return out


def span_batch(
    p: SpanPieces, n: int, bos: int, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n` rows of WIDTH tokens, their labels, and the mask of the labelled tokens (for
    `span_accuracy`: a row is right when every one is)."""
    ids = torch.empty((n, WIDTH), dtype=torch.long)
    labels = torch.full((n, WIDTH), -100)
    for r in range(n):
        room = -1
        while room < 0:  # a long draw does not fit: draw again
            x = name(p, rng)
            if rng.random() < 0.5:
                end = list(rng.choice(p.ends))
            else:
                end = p.space + rng.choice(p.tail_words) + list(rng.choice(p.ends))
            opening, close = rng.choice(p.quotes)
            tail = opening + x + close
            body = rng.choice(p.intros) + x + end
            room = WIDTH - 1 - len(body) - len(tail)
        before = rng.randint(0, room)
        fill = [rng.choice(p.filler) for _ in range(room)]
        row = [bos] + fill[:before] + body + fill[before:] + tail
        ids[r] = torch.tensor(row)
        start = WIDTH - len(x) - len(close)
        labels[r, start + 1 :] = ids[r, start + 1 :]
    return ids, labels, labels != -100


@torch.no_grad()
def span_accuracy(model, batch) -> float:
    """The share of rows whose copy and close are all right (greedy, teacher-forced)."""
    ids, _, mask = batch
    was_training = model.training
    model.eval()
    pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
    model.train(was_training)
    m = mask[:, 1:]
    right = (pred == ids[:, 1:]) | ~m
    return right.all(1).float().mean().item()
