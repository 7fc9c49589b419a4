"""A wave of prompts sent at once, served against the engine alone: where agent c64's TTFT p99 goes.

    .venv/bin/python bench/wave.py [--model demo/tandem-demo] [--prompts 64] [--prompt-len 432]
                                   [--max-tokens 64] [--rounds 3]

`bench/serving.py`'s agent c64 TTFT p99 is the last first token of its first wave: 64 prompts
(first agent turns, ~520 tokens) sent at once. This bench sends such a wave to the stack `make
run` starts (deploy/stack.py: Envoy, the gateway, one worker), streamed completions from one
thread each, and times the last first token; in turns with the same prompts (new ones each round,
so nothing is cached) added at once to an engine in this process, its default configuration (the
baseline: the wave's compute with no front end). Per round it prints both, their ratio, the
served worker's engine steps, and the CPU seconds each process spent until the last first token
(the client is this process's threads; two cores give 2 CPU-s a second).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import threading
import time

import psutil

from bench.serving import random_text, stack_usage
from deploy.stack import start_stack

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wave_texts(tokenizer, count: int, length: int, seed: int) -> list[str]:
    """Prompts of `length` random token ids, as text (as bench/serving.py's agent prompts)."""
    rng = random.Random(seed)
    return [random_text(tokenizer, rng, length) for _ in range(count)]


def stream(address: str, model: str, prompt: str, max_tokens: int, on_first) -> None:
    """Streams one completion to its end, calling on_first() at its first token."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200:
        raise RuntimeError(f"HTTP {reply.status}: {reply.read()[:300]!r}")
    first = True
    for line in reply:
        if first and line.startswith(b"data: "):
            on_first()
            first = False
    conn.close()


def usage(stack) -> dict:
    """The stack's CPU seconds per process and engine steps so far, with this process's (the
    client's) CPU seconds."""
    out = stack_usage(stack)
    times = psutil.Process().cpu_times()
    out["cpu_s"]["client"] = times.user + times.system
    return out


def served(stack, model: str, prompts: list[str], max_tokens: int) -> dict:
    before = usage(stack)
    firsts: list[float] = []
    start = time.perf_counter()
    address = stack.envoy_address

    def one(prompt):
        stream(
            address, model, prompt, max_tokens, lambda: firsts.append(time.perf_counter() - start)
        )

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    while len(firsts) < len(prompts) and any(t.is_alive() for t in threads):
        time.sleep(0.001)
    after = usage(stack)
    for thread in threads:
        thread.join()
    if len(firsts) < len(prompts):
        raise RuntimeError("a request failed (see the stack's log)")
    return {
        "last_first_s": max(firsts),
        "steps": after["steps"] - before["steps"],
        "step_s": after["step_s"] - before["step_s"],
        "cpu_s": {role: s - before["cpu_s"][role] for role, s in after["cpu_s"].items()},
    }


def alone(engine, ids: list[list[int]], max_tokens: int, tag: str) -> dict:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(ids):
        engine.add_request(f"{tag}-{i}", prompt, params)
    start, steps = time.perf_counter(), 0
    while any(not seq.output_token_ids for seq in engine.seqs.values()):
        engine.step()
        steps += 1
    last_first = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return {"last_first_s": last_first, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=os.path.join(REPO_ROOT, "demo", "tandem-demo"))
    ap.add_argument("--prompts", type=int, default=64, help="prompts in the wave")
    ap.add_argument("--prompt-len", type=int, default=432, help="random token ids a prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from tokenizers import Tokenizer

    from engine.config import EngineConfig
    from engine.layers import fused
    from engine.llm_engine import LLMEngine

    if why := fused.stale():  # both sides would run torch's kernels
        raise SystemExit(why)

    tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    name = os.path.basename(os.path.normpath(args.model))
    print(f"CPU: {psutil.cpu_count()} cores; {args.prompts} prompts at once, {name}")
    engine = LLMEngine(EngineConfig(model=args.model, device="cpu"))
    stack = start_stack(args.model)
    try:
        warm = wave_texts(tokenizer, 8, args.prompt_len, seed=0)
        served(stack, name, warm, args.max_tokens)
        alone(engine, [tokenizer.encode(t).ids for t in warm], args.max_tokens, "warm")
        print(
            "round  served s  alone s  served/alone  served steps (s)  CPU-s to the last first token"
        )
        for r in range(args.rounds):
            texts = wave_texts(tokenizer, args.prompts, args.prompt_len, seed=1 + r)
            ids = [tokenizer.encode(t).ids for t in texts]
            base = alone(engine, ids, args.max_tokens, f"r{r}")
            wave = served(stack, name, texts, args.max_tokens)  # the worker's own cache: cold
            cpu = "  ".join(f"{role} {s:.2f}" for role, s in wave["cpu_s"].items())
            print(
                f"{r:5d}  {wave['last_first_s']:8.3f}  {base['last_first_s']:7.3f}"
                f"  {wave['last_first_s'] / base['last_first_s']:11.2f}x"
                f"  {wave['steps']:5.0f} ({wave['step_s']:.2f})  {cpu}",
                flush=True,
            )
    finally:
        stack.stop()
        engine.close()


if __name__ == "__main__":
    main()
