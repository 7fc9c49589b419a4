"""Held-out copy check: does the demo model copy the name from the prompt into its tool call?

    python demo/copy_check.py [--model demo/tandem-demo] [--made-up] [demo/train.py's flags]

Real names (default), four sets, none of them in the training corpus:
- `real`: 50 single-word ASCII cities, in get_weather calls;
- `multi-word`: 20 cities of two to four words ("Rio de Janeiro", "Salt Lake City");
- `accented`: 20 cities with letters outside ASCII ("Zürich", "São Paulo", "Łódź"), which the
  byte-level tokenizer splits into byte pieces;
- `people`: 20 people's names, plain and accented, in search calls ("Look up Ada Lovelace.").
"Not in the corpus" is checked here against what demo/train.py trains on with the flags given
after these (the model's recipe; none: `make demo-model`'s): the corpus and the extra rows of
made-up names' calls, case-insensitive, whole words: no word of a name occurs there, except the
generic place words of GENERIC ("City", "San", "de"), and the whole name does not either. The
names are in demo/held_out.py, whose words the corpus generator never makes.

`--made-up`: 60 made-up place names from demo/corpus.py's generator (the recipe's: plain or rich)
under another seed, in get_weather calls, reported by kind (single word, several words,
accented), checked likewise.

`--answers`: the turn after the call instead, for the 90 real places: the tool's result (a
seeded temperature, each condition of the corpus in turn) and the answer that must restate it
exactly as the corpus does ("It is 18 degrees celsius and sunny in Zürich.").

Greedy answers through tandem's engine; prints each miss, each set's exact-copy rate and the
overall one. Exit status 1 when a set or the whole is below 90%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys

from demo.check import tool_calls
from demo.corpus import CONDITIONS, RICH, TOOLS, Names, novel_name
from demo.held_out import ACCENTED, GENERIC, MULTI_WORD, PEOPLE, REAL
from demo.template import make_renderer
from demo.train import SEED, build_parser, config, corpus_conversations, drill_conversations

TARGET = 0.9
WEATHER = [
    "What's the weather like in {n}?",
    "What's the weather in {n}?",
    "How is the weather in {n} today?",
    "Weather in {n}?",
    "Tell me the weather in {n}.",
    "What is the temperature in {n}?",
]
SEARCH = [
    "Search for {n}.",
    "Look up {n}.",
    "Find information about {n}.",
    "Can you search for {n}?",
    "Search the web for {n}.",
]
# Every other prompt offers all four tools, as a client with several tools would.
ALL_TOOLS = [TOOLS[n] for n in sorted(TOOLS)]
# (tool, argument, prompt templates, tool sets) of each kind of request.
REQUESTS = {
    "get_weather": ("city", WEATHER, [[TOOLS["get_weather"]], ALL_TOOLS]),
    "search": ("query", SEARCH, [[TOOLS["search"]], ALL_TOOLS]),
}


def corpus_text(cfg: dict) -> str:
    """Everything demo/train.py trains on with `cfg`, as it renders it, lower-cased: the corpus and
    the extra rows of made-up names' calls and chat turns."""
    render = make_renderer()
    convs = corpus_conversations(cfg) + drill_conversations(cfg)
    return "\n".join(render(messages, tools) for messages, tools in convs).lower()


def words(name: str) -> list[str]:
    return [w.lower() for w in re.findall(r"[^\W\d_]+", name)]


def unseen(name: str, seen_words: set[str], text: str) -> bool:
    """No word of `name` but the generic ones is in the corpus, nor is the whole name."""
    if any(w in seen_words and w not in GENERIC for w in words(name)):
        return False
    return re.search(r"(?<!\w)" + re.escape(name.lower()) + r"(?!\w)", text) is None


def kind(name: str) -> str:
    if not name.isascii():
        return "made-up accented"
    return "made-up multi-word" if " " in name else "made-up single-word"


def made_up_sets(seen_words: set[str], text: str, names: Names | None) -> dict[str, list[str]]:
    """60 made-up names of the corpus generator under another seed: up to 30 single words, 15 of
    several words and 15 accented (fewer of a kind the generator does not make)."""
    rng, quota = (
        random.Random(SEED + 1),
        {
            "made-up single-word": 30,
            "made-up multi-word": 15,
            "made-up accented": 15,
        },
    )
    sets: dict[str, list[str]] = {k: [] for k in quota}
    for _ in range(20000):
        name = novel_name(rng, names)
        group = sets[kind(name)]
        if len(group) < quota[kind(name)] and name not in group and unseen(name, seen_words, text):
            group.append(name)
        if all(len(sets[k]) == quota[k] for k in quota):
            break
    return {k: v for k, v in sets.items() if v}


def copies(tool: str, name: str):
    """Whether a reply is the one call of `tool` whose argument is `name`."""

    def right(reply: str) -> bool:
        try:
            calls = tool_calls(reply)
        except ValueError:
            return False
        return (
            len(calls) == 1
            and calls[0].get("name") == tool
            and isinstance(calls[0].get("arguments"), dict)
            and calls[0]["arguments"].get(REQUESTS[tool][0]) == name
        )

    return right


def answer_case(tok, name: str, i: int, rng: random.Random):
    """(ask, prompt ids, whether a reply is right): the turn after a weather call for `name`."""
    ask = WEATHER[i % len(WEATHER)].format(n=name)
    temperature, condition = rng.randint(-5, 35), CONDITIONS[i % len(CONDITIONS)]
    result = {"city": name, "temperature": temperature, "unit": "celsius", "condition": condition}
    arguments = {"city": name, "unit": "celsius"}
    call = {"name": "get_weather", "arguments": json.dumps(arguments, ensure_ascii=False)}
    messages = [
        {"role": "user", "content": ask},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "content": json.dumps(result, ensure_ascii=False)},
    ]
    prompt = tok.encode(tok.apply_chat_template(messages, tools=[TOOLS["get_weather"]]))
    answer = f"It is {temperature} degrees celsius and {condition} in {name}."
    return f"{ask} ({condition}, {temperature})", prompt, lambda reply: reply.strip() == answer


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--model", default=os.path.join(here, "tandem-demo"))
    parser.add_argument(
        "--made-up", action="store_true", help="made-up names (another seed) instead of real ones"
    )
    parser.add_argument(
        "--answers", action="store_true", help="answers from weather results instead of calls"
    )
    args, recipe = parser.parse_known_args()
    cfg = config(build_parser().parse_args(recipe))
    text = corpus_text(cfg)
    seen_words = set(re.findall(r"[^\W\d_]+", text))
    if args.made_up:
        names = RICH if cfg["names"] == "rich" else None
        sets = {
            k: [("get_weather", n) for n in v]
            for k, v in made_up_sets(seen_words, text, names).items()
        }
    else:
        sets = {
            "real": [("get_weather", n) for n in REAL],
            "multi-word": [("get_weather", n) for n in MULTI_WORD],
            "accented": [("get_weather", n) for n in ACCENTED],
            "people": [("search", n) for n in PEOPLE],
        }
        leaked = [n for v in sets.values() for _, n in v if not unseen(n, seen_words, text)]
        assert not leaked, f"in the training corpus: {leaked}"

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_bytes=64 << 20))
    tok = engine.tokenizer
    if args.answers:
        sets = {"answers": [n for k in ("real", "multi-word", "accented") for _, n in sets[k]]}
    rng = random.Random(SEED + 2)
    cases = []  # (set, ask, prompt ids, whether a reply is right)
    for set_name, requests in sets.items():
        for i, request in enumerate(requests):
            if args.answers:
                cases.append((set_name, *answer_case(tok, request, i, rng)))
                continue
            tool, name = request
            _, templates, tool_sets = REQUESTS[tool]
            ask = templates[i % len(templates)].format(n=name)
            messages = [{"role": "user", "content": ask}]
            prompt = tok.encode(tok.apply_chat_template(messages, tools=tool_sets[i % 2]))
            cases.append((set_name, ask, prompt, copies(tool, name)))
    outputs = engine.generate([c[2] for c in cases], SamplingParams(max_tokens=64, temperature=0))
    copied = {k: 0 for k in sets}
    for (set_name, ask, _, right), out in zip(cases, outputs):
        reply = tok.decode(out.token_ids)
        ok = right(reply)
        copied[set_name] += ok
        if not ok:
            print(f"[MISS] {set_name}: {ask!r} -> {reply}")
    failed = False
    for set_name, requests in sets.items():
        rate = copied[set_name] / len(requests)
        failed |= rate < TARGET
        print(f"{set_name}: {copied[set_name]}/{len(requests)} copied exactly ({rate:.0%})")
    total, num = sum(copied.values()), sum(len(v) for v in sets.values())
    failed |= total / num < TARGET
    print(f"overall: {total}/{num} copied exactly ({total / num:.0%})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
