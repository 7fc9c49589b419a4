"""Speculation under the families' own markup, through `make run MODEL=`: with SPECULATIVE=ngram
and a prediction (OpenAI's Predicted Outputs) of the whole reply, verified steps hand the
reasoning and tool-call parsers many tokens at once, one step spanning the end of reasoning
and the start of the call; the stream is what plain decoding (SPECULATIVE=off, no prediction)
streams: the same reasoning, content, calls and finish."""

from __future__ import annotations

import json
import os

import openai
import pytest

from tests.e2e.test_published_checkpoints import (
    KIMI_REPLY,
    WEATHER_QUESTION,
    WEATHER_TOOL,
    kimi_k2_thinking,
    served,
)
from tests.e2e.test_published_families import QWEN3_REPLY, rigged
from tests.published_tokenizers import qwen3_tokenizer


def qwen3(tmp_path) -> str:
    return rigged(
        str(tmp_path / "Qwen3-8B"),
        "qwen3",
        qwen3_tokenizer,
        "Qwen-Qwen3-0.6B.jinja",
        QWEN3_REPLY,
        vocab_size=151936,
    )


FAMILIES = {
    "qwen3": (qwen3, QWEN3_REPLY, "<|im_end|>"),
    "kimi_k2_thinking": (kimi_k2_thinking, KIMI_REPLY, "<|im_end|>"),
}


def streamed(client, name: str, **extra) -> tuple[dict, object]:
    """The weather question streamed: what the deltas add up to (call ids aside: hermes' are
    random), and the usage."""
    chunks = list(
        client.chat.completions.create(
            model=name,
            messages=[WEATHER_QUESTION],
            tools=[WEATHER_TOOL],
            max_tokens=100,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **extra,
        )
    )
    choices = [c.choices[0] for c in chunks if c.choices]
    calls: dict[int, dict] = {}
    for choice in choices:
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": "", "ids": 0})
            entry["ids"] += bool(call.id)
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    result = {
        "reasoning": "".join(c.delta.model_extra.get("reasoning_content") or "" for c in choices),
        "content": "".join(c.delta.content or "" for c in choices),
        "calls": calls,
        "finish": [c.finish_reason for c in choices if c.finish_reason],
    }
    return result, chunks[-1].usage


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_prediction_across_reasoning_and_a_call_streams_what_plain_decoding_does(
    tmp_path, monkeypatch, family
):
    build, reply, end = FAMILIES[family]
    folder = build(tmp_path)
    name, runs = os.path.basename(folder), {}
    for method, extra in (
        ("off", {}),
        (
            "ngram",
            {"extra_body": {"prediction": {"type": "content", "content": reply.removesuffix(end)}}},
        ),
    ):
        monkeypatch.setenv("SPECULATIVE", method)
        with served(folder) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
            runs[method] = streamed(client, name, **extra)
    (plain, _), (speculated, usage) = runs["off"], runs["ngram"]
    # verified steps of several tokens
    assert usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert speculated == plain
    assert "The user wants the weather." in plain["reasoning"] and plain["finish"] == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"]), c["ids"]) for c in plain["calls"].values()] == [
        ("get_weather", {"city": "Paris"}, 1)
    ]
