"""demo/corpus.py's extra rows: answers from a tool's result restate it (city, temperature,
condition), in the share asked for, and none without it."""

from __future__ import annotations

import json

import pytest

from demo.corpus import drills

pytestmark = pytest.mark.unit


def test_answer_rows_restate_their_result_in_the_share_asked():
    rows = drills(7, 400, 0.3333, 0.5, 0.75, answer=0.25)
    answers = [m for m, _ in rows if any(turn["role"] == "tool" for turn in m)]
    assert 70 <= len(answers) <= 130
    for messages in answers:
        result = json.loads(messages[-2]["content"])
        call = json.loads(messages[-3]["tool_calls"][0]["function"]["arguments"])
        assert call["city"] == result["city"] and call["unit"] == result["unit"]
        assert messages[-1] == {
            "role": "assistant",
            "content": f"It is {result['temperature']} degrees {result['unit']} and "
            f"{result['condition']} in {result['city']}.",
        }


def test_without_answers_the_rows_hold_none():
    rows = drills(7, 400, 0.3333, 0.5, 0.75)
    assert not [m for m, _ in rows if any(turn["role"] == "tool" for turn in m)]
