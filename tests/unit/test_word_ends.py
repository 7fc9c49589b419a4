"""demo/train.py's weighted name ends: the tokens where a copied name goes on or stops."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from tokenizers import Tokenizer

from demo.corpus import Names, drills, name_call
from demo.template import make_renderer
from demo.train import call_rows, reply_loss, word_ends
from deploy.processes import REPO_ROOT

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(os.path.join(REPO_ROOT, "demo", "tandem-demo", "tokenizer.json"))


def test_the_token_after_each_word_of_a_calls_names(tok):
    messages = [
        {"role": "user", "content": "How is the weather in Vorna de Kell today?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Vorna de Kell", "unit": "celsius"}',
                    },
                }
            ],
        },
    ]
    text = make_renderer()(messages, None)
    ids = tok.encode(text, add_special_tokens=False).ids
    ends = word_ends(tok, text, messages)
    # after "Vorna" and "de" a space goes on; after "Kell" and "celsius" the value closes
    assert [tok.decode([ids[i]]) for i in ends] == [" ", " ", '",', '"}}']
    before = [tok.decode(ids[:i]) for i in ends]
    assert [b.rsplit('"', 1)[-1] for b in before] == [
        "Vorna",
        "Vorna de",
        "Vorna de Kell",
        "celsius",
    ]
    # chat turns have no call
    assert word_ends(tok, "hi", [{"role": "assistant", "content": "Hello!"}]) == []


def test_weights_fall_on_labelled_reply_tokens_only_and_scale_their_loss(tok):
    convs = drills(5, 24, 0.3333, 0.5, 0.75, Names(known_first=0.5))
    ids, labels, weights = call_rows(tok, convs, 8.0)
    plain_ids, plain_labels, ones = call_rows(tok, convs)
    assert torch.equal(ids, plain_ids) and torch.equal(labels, plain_labels)
    assert torch.all(ones == 1)
    heavy = weights == 8.0
    assert torch.all(labels[heavy] != -100)
    calls = [i for i, (messages, _) in enumerate(convs) if messages[-1].get("tool_calls")]
    assert calls and all(heavy[i].sum() >= 1 for i in calls)  # at least a name's end
    assert all(heavy[i].sum() == 0 for i in range(len(convs)) if i not in calls)

    torch.manual_seed(0)

    class Tiny(torch.nn.Module):  # reply_loss reads .model(...).last_hidden_state and .lm_head
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(tok.get_vocab_size(with_added_tokens=True), 8)
            self.lm_head = torch.nn.Linear(8, self.embed.num_embeddings)

        def model(self, input_ids):
            return type("Out", (), {"last_hidden_state": self.embed(input_ids)})

    tiny = Tiny()
    plain = reply_loss(tiny, ids, labels)
    assert torch.allclose(reply_loss(tiny, ids, labels, ones), plain)
    assert reply_loss(tiny, ids, labels, weights) > plain


def test_a_name_calls_multi_word_name_gets_one_end_per_word(tok):
    rng = random.Random(11)
    for _ in range(40):
        messages, tools = name_call(rng, multi=1.0, tail=0.75)
        text = make_renderer()(messages, tools)
        args = messages[-1]["tool_calls"][0]["function"]["arguments"]
        ends = word_ends(tok, text, messages)
        expected = sum(len(v.split()) for v in json.loads(args).values() if isinstance(v, str))
        assert len(ends) == expected
