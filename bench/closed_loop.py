"""The engine alone under bench/serving.py's load, in one process: what the served figures would
be with no front end (gateway, Envoy, gRPC, the load generator) sharing the CPUs.

    .venv/bin/python bench/closed_loop.py [--model demo/tandem-demo] [--concurrency 1,16,64]
                                          [--num-prompts 64,256,512] [--input-len 256]
                                          [--output-len 64] [--dtype float32]

Closed loop, as `vllm bench serve --max-concurrency` drives a server: `concurrency` random
prompts (greedy, `ignore_eos`), and a new one each time one finishes, until `num-prompts` are
done. Prints output tokens a second, steps, and ms a step, per level; the engine uses every
thread torch has (a served worker computes on its own CPUs and borrows the front end's for
waves: engine/step_threads.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time

import torch

from engine.config import EngineConfig
from engine.layers.kernel_choice import cpu_model
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_level(eng: LLMEngine, concurrency: int, num_prompts: int, args, rng: random.Random):
    """(output tokens a second, steps, seconds) for one concurrency level."""
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    vocab = eng.model_config.vocab_size
    sent = 0

    def send() -> None:
        nonlocal sent
        prompt = [rng.randrange(3, vocab) for _ in range(args.input_len)]
        eng.add_request(f"c{concurrency}-{sent}", prompt, params)
        sent += 1

    for _ in range(min(concurrency, num_prompts)):
        send()
    steps, start = 0, time.perf_counter()
    while eng.has_unfinished_requests():
        running = set(eng.seqs)
        eng.step()
        steps += 1
        for _ in running - set(eng.seqs):  # each finished request makes room for the next
            if sent < num_prompts:
                send()
    wall = time.perf_counter() - start
    return num_prompts * args.output_len / wall, steps, wall


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=os.path.join(REPO_ROOT, "demo", "tandem-demo"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--num-prompts", default="64,256,512")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = [int(n) for n in args.num_prompts.split(",")]
    if len(prompts) != len(levels):
        ap.error("--num-prompts needs one number per --concurrency level")
    eng = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype))
    print(
        f"CPU: {cpu_model()} ({platform.machine()}), {torch.get_num_threads()} threads; "
        f"{os.path.basename(args.model)} {args.dtype}, {args.input_len} in / {args.output_len} out"
    )
    rng = random.Random(0)
    run_level(eng, levels[0], levels[0], args, rng)  # warm-up
    for concurrency, num_prompts in zip(levels, prompts):
        tok_s, steps, wall = run_level(eng, concurrency, num_prompts, args, rng)
        print(
            f"  concurrency {concurrency:3}, {num_prompts} prompts: {tok_s:8.1f} output tok/s, "
            f"{steps} steps, {wall / steps * 1e3:.2f} ms a step"
        )


if __name__ == "__main__":
    main()
