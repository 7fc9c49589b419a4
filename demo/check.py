"""Check the demo model with tandem's own engine: greedy answers are right, readable, and stop.

    python demo/check.py [--model demo/tandem-demo]

Prints each transcript and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from demo.corpus import TOOLS
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def tool_calls(text: str) -> list[dict]:
    """The JSON objects inside <tool_call>...</tool_call> spans (the gateway's parse)."""
    return [json.loads(span) for span in TOOL_CALL.findall(text)]


def greeting(text, calls):
    return any(w in text.lower() for w in ("hello", "hi", "hey")) and text.rstrip().endswith(
        ("!", ".", "?")
    )


def weather_call(city):
    def ok(text, calls):
        return (
            len(calls) == 1
            and calls[0].get("name") == "get_weather"
            and calls[0].get("arguments", {}).get("city") == city
        )

    return ok


CASES = [
    ("greeting", [{"role": "user", "content": "Hello!"}], None, greeting),
    (
        "capital",
        [{"role": "user", "content": "What is the capital of France?"}],
        None,
        lambda text, calls: "Paris" in text and not calls,
    ),
    (
        "capital, with a system prompt",
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What's the capital of Japan?"},
        ],
        None,
        lambda text, calls: "Tokyo" in text,
    ),
    (
        "arithmetic",
        [{"role": "user", "content": "What is 3 plus 4?"}],
        None,
        lambda text, calls: "7" in text,
    ),
    (
        "weather tool call",
        [{"role": "user", "content": "What's the weather like in Paris?"}],
        [TOOLS["get_weather"]],
        weather_call("Paris"),
    ),
    (
        "weather tool call, several tools",
        [{"role": "user", "content": "What is the weather in Tokyo?"}],
        [TOOLS["get_time"], TOOLS["get_weather"], TOOLS["search"]],
        weather_call("Tokyo"),
    ),
    (
        "answer from a tool result",
        [
            {"role": "user", "content": "What's the weather in Berlin?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": json.dumps({"city": "Berlin", "unit": "celsius"}),
                        },
                    }
                ],
            },
            {
                "role": "tool",
                "content": json.dumps(
                    {"city": "Berlin", "temperature": 21, "unit": "celsius", "condition": "sunny"}
                ),
            },
        ],
        [TOOLS["get_weather"]],
        lambda text, calls: all(w in text for w in ("21", "sunny", "Berlin")) and not calls,
    ),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "tandem-demo")
    )
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_bytes=64 << 20))
    tok = engine.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template(messages, tools=tools))
        for _, messages, tools, _ in CASES
    ]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=96, temperature=0))
    failures = 0
    for (name, messages, tools, ok), out in zip(CASES, outputs):
        text = tok.decode(out.token_ids)
        stopped = out.finish_reason == "stop" and out.token_ids[-1] in engine.eos_token_ids
        try:
            calls = tool_calls(text)
            passed = stopped and ok(text, calls)
        except (ValueError, AttributeError) as exc:
            calls, passed = f"unparseable: {exc}", False
        failures += not passed
        tools_note = f" (tools: {', '.join(t['function']['name'] for t in tools)})" if tools else ""
        print(f"[{'PASS' if passed else 'FAIL'}] {name}{tools_note}")
        for m in messages:
            shown = m["content"] or json.dumps(m.get("tool_calls"))
            print(f"  {m['role']:>9}: {shown}")
        print(f"  {'model':>9}: {text}")
        print(
            f"  {'':>9}  finish={out.finish_reason}, {len(out.token_ids)} tokens"
            + (f", tool calls: {json.dumps(calls)}" if calls else "")
        )
    print(f"{len(CASES) - failures}/{len(CASES)} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
