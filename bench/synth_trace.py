"""Synthetic traces in the Mooncake trace's format (bench/traces/README.md), for routing on
shapes the production trace does not have.

    .venv/bin/python bench/synth_trace.py --shape deep|bursty|many [--seed 0] [--out PATH]

A trace is `--sessions` conversations. Every prompt starts with the system prompt shared by all
(`system_blocks` blocks), then its conversation's history: turn k's prompt is turn k-1's prompt,
its reply (output_length / 512 blocks, at least 1) and `user_blocks` new blocks, so a
conversation's turns share ever deeper prefixes. A conversation's first turn may also open with
one of `num_documents` shared documents (`document_blocks` blocks, with probability
`document_share`): prefixes shared across conversations below the system prompt. Conversations
start at random times over `duration_s`; in `bursty` they start in bursts (`burst_size` at once,
bursts `duration_s / num_bursts` apart). Turns of a conversation are `think_s` apart (exponential).
One JSON object a line: timestamp (ms), input_length, output_length (tokens), hash_ids (one id a
512-token block). The same seed gives the same trace.

Shapes:
- `deep`: 150 long conversations (12 turns) over 4 documents of 24 blocks: deep sharing;
- `bursty`: 300 conversations of 3 turns arriving in bursts of 30: load spikes on shared prefixes;
- `many`: 1,500 short conversations (2 turns), a 2-block system prompt, no documents: shallow
  sharing, a working set far above the fleet's cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

BLOCK_TOKENS = 512
SHAPES = {
    "deep": dict(sessions=150, turns=12, system_blocks=4, user_blocks=2, num_documents=4,
                 document_blocks=24, document_share=0.8, duration_s=900, think_s=60,
                 num_bursts=0, burst_size=0),
    "bursty": dict(sessions=300, turns=3, system_blocks=6, user_blocks=3, num_documents=20,
                   document_blocks=8, document_share=0.5, duration_s=600, think_s=20,
                   num_bursts=10, burst_size=30),
    "many": dict(sessions=1500, turns=2, system_blocks=2, user_blocks=4, num_documents=0,
                 document_blocks=0, document_share=0.0, duration_s=900, think_s=30,
                 num_bursts=0, burst_size=0),
}  # fmt: skip


def generate(shape: dict, seed: int) -> list[dict]:
    rng = random.Random(seed)
    next_id = itertools.count()
    system = [next(next_id) for _ in range(shape["system_blocks"])]
    documents = [
        [next(next_id) for _ in range(shape["document_blocks"])]
        for _ in range(shape["num_documents"])
    ]
    rows = []
    for s in range(shape["sessions"]):
        if shape["num_bursts"]:
            start = (s // shape["burst_size"]) % shape["num_bursts"] * (
                shape["duration_s"] / shape["num_bursts"]
            ) + rng.uniform(0, 1)
        else:
            start = rng.uniform(0, shape["duration_s"])
        prompt = list(system)
        if documents and rng.random() < shape["document_share"]:
            prompt += rng.choice(documents)
        at = start
        for _ in range(shape["turns"]):
            prompt = prompt + [next(next_id) for _ in range(shape["user_blocks"])]
            output = rng.randint(50, 1000)
            rows.append(
                {
                    "timestamp": int(at * 1000),
                    "input_length": len(prompt) * BLOCK_TOKENS - rng.randint(0, BLOCK_TOKENS - 1),
                    "output_length": output,
                    "hash_ids": list(prompt),
                }
            )
            prompt = prompt + [next(next_id) for _ in range(max(1, output // BLOCK_TOKENS))]
            at += rng.expovariate(1 / shape["think_s"])
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default="", help="JSONL path (default: bench/traces/synth_SHAPE.jsonl)"
    )
    args = ap.parse_args()
    path = args.out or f"bench/traces/synth_{args.shape}.jsonl"
    rows = generate(SHAPES[args.shape], args.seed)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{path}: {len(rows)} requests")


if __name__ == "__main__":
    main()
