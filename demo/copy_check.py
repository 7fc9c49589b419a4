"""Held-out copy check: does the demo model put the city from the prompt into its get_weather call?

    python demo/copy_check.py [--model demo/tandem-demo] [--made-up] [--novel F]

50 weather requests about real cities that never occur in the training corpus (checked here
against demo/train.py's FULL corpus with the model's `--novel`, case-insensitive, whole words),
or with `--made-up` about 50 made-up names from demo/corpus.py's generator under another seed
(checked likewise). Greedy answers through tandem's engine; prints each miss and the exact-copy
rate. Exit status 1 below 80%.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys

from demo.check import tool_calls
from demo.corpus import TOOLS, conversations, novel_name
from demo.template import make_renderer
from demo.train import FULL, SEED

# Real cities absent from the corpus' city, capital, timezone and topic lists.
HELD_OUT = [
    "Marseille",
    "Lyon",
    "Porto",
    "Seville",
    "Valencia",
    "Barcelona",
    "Naples",
    "Milan",
    "Florence",
    "Venice",
    "Hamburg",
    "Cologne",
    "Frankfurt",
    "Krakow",
    "Gdansk",
    "Bergen",
    "Gothenburg",
    "Antwerp",
    "Rotterdam",
    "Geneva",
    "Salzburg",
    "Edinburgh",
    "Glasgow",
    "Manchester",
    "Liverpool",
    "Kyoto",
    "Nagoya",
    "Sapporo",
    "Busan",
    "Taipei",
    "Manila",
    "Karachi",
    "Dhaka",
    "Chennai",
    "Casablanca",
    "Tunis",
    "Accra",
    "Lagos",
    "Denver",
    "Austin",
    "Houston",
    "Miami",
    "Atlanta",
    "Vancouver",
    "Montreal",
    "Havana",
    "Bogota",
    "Quito",
    "Montevideo",
    "Auckland",
]
TEMPLATES = [
    "What's the weather like in {c}?",
    "What's the weather in {c}?",
    "How is the weather in {c} today?",
    "Weather in {c}?",
    "Tell me the weather in {c}.",
    "What is the temperature in {c}?",
]
# Every other prompt offers all four tools, as a client with several tools would.
TOOL_SETS = [[TOOLS["get_weather"]], [TOOLS[n] for n in sorted(TOOLS)]]


def corpus_words(novel: float) -> set[str]:
    """Every word of the training corpus (FULL, as demo/train.py renders it), lower-cased."""
    render = make_renderer()
    words: set[str] = set()
    for messages, tools in conversations(SEED, FULL["num_conversations"], novel):
        words.update(w.lower() for w in re.findall(r"[^\W\d_]+", render(messages, tools)))
    return words


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--model", default=os.path.join(here, "tandem-demo"))
    parser.add_argument(
        "--made-up", action="store_true", help="made-up names (another seed) instead of real cities"
    )
    parser.add_argument(
        "--novel", type=float, default=FULL["novel"], help="the model's demo/train.py --novel"
    )
    args = parser.parse_args()
    seen = corpus_words(args.novel)
    if args.made_up:
        rng, cities = random.Random(SEED + 1), []
        while len(cities) < 50:
            name = novel_name(rng)
            if name not in cities and not any(w.lower() in seen for w in name.split()):
                cities.append(name)
    else:
        cities = HELD_OUT
        leaked = [c for c in cities if any(w.lower() in seen for w in c.split())]
        assert not leaked, f"in the training corpus: {leaked}"

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_bytes=64 << 20))
    tok = engine.tokenizer
    asks = [TEMPLATES[i % len(TEMPLATES)].format(c=c) for i, c in enumerate(cities)]
    prompts = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": ask}], tools=TOOL_SETS[i % 2])
        )
        for i, ask in enumerate(asks)
    ]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=64, temperature=0))
    copied = 0
    for i, (city, out) in enumerate(zip(cities, outputs)):
        text = tok.decode(out.token_ids)
        try:
            calls = tool_calls(text)
        except ValueError:
            calls = []
        ok = (
            len(calls) == 1
            and calls[0].get("name") == "get_weather"
            and isinstance(calls[0].get("arguments"), dict)
            and calls[0]["arguments"].get("city") == city
        )
        copied += ok
        if not ok:
            print(f"[MISS] {asks[i]!r} -> {text}")
    rate = copied / len(cities)
    print(
        f"{'made-up' if args.made_up else 'held-out real'} cities: {copied}/{len(cities)} copied exactly "
        f"({rate:.0%})"
    )
    return 0 if rate >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
