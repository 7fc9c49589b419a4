"""Whole engine steps, the working tree against a baseline revision, interleaved in one process
(so both see the same machine state):

    .venv/bin/python bench/decode_step.py [--baseline REV] [--model DIR] [--dtypes float32,bfloat16]
                                          [--batches 1,16] [--context 200] [--prefill 512]

REV's `engine/` package is extracted with `git archive` and imported beside the working tree's
(each engine keeps its own modules). For each dtype, both engines are built, each gets the same
`batch` sequences of `--context` random tokens, then rounds alternate between them: each round
settles for 3 steps and times 20 decode steps. `--prefill N` also times one step that prefills a
new N-token prompt, alternating the same way. Prints min and median ms per step and the ratio
of medians. On this machine separate runs of the same code differ by 20-30%; interleaving is what
makes a 10% change visible.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from engine.config import EngineConfig
from engine.layers.kernel_choice import cpu_model
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROUNDS, SETTLE, STEPS = 6, 3, 20


def _engine_modules() -> dict:
    return {
        name: m for name, m in sys.modules.items() if name == "engine" or name.startswith("engine.")
    }


@contextlib.contextmanager
def baseline_engine_package(rev: str):
    """While open, `import engine...` gives REV's package; the working tree's comes back after."""
    folder = tempfile.mkdtemp(prefix="tandem-baseline-")
    archive = subprocess.run(
        ["git", "archive", rev, "engine"], cwd=REPO_ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    # REV's CPU ops are the working tree's build where its sources are the same (the build is
    # named by them); otherwise it runs without them, as it warns.
    os.symlink(os.path.join(REPO_ROOT, "build"), os.path.join(folder, "build"))
    ours = _engine_modules()
    for name in ours:
        del sys.modules[name]
    # REV's package under the name `engine`: its submodules resolve through its own __path__.
    init = os.path.join(folder, "engine", "__init__.py")
    spec = importlib.util.spec_from_file_location(
        "engine", init, submodule_search_locations=[os.path.dirname(init)]
    )
    sys.modules["engine"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["engine"])
    try:
        yield
    finally:
        for name in _engine_modules():
            del sys.modules[name]
        sys.modules.update(ours)


# Sequences as long as this at most: a pool of 256 MiB holds one of them whatever the model's
# own length (Kimi-shaped checkpoints declare 256k).
MAX_MODEL_LEN = 2048


def build(rev: str | None, model: str, dtype: str):
    """An engine (REV's, or the working tree's for None) and its SamplingParams class."""
    if rev is None:
        return LLMEngine(
            EngineConfig(
                model=model, dtype=dtype, kv_cache_bytes=256 << 20, max_model_len=MAX_MODEL_LEN
            )
        ), SamplingParams
    with baseline_engine_package(rev):
        config = importlib.import_module("engine.config")
        llm_engine = importlib.import_module("engine.llm_engine")
        params = importlib.import_module("engine.sampling_params").SamplingParams
        return llm_engine.LLMEngine(
            config.EngineConfig(
                model=model, dtype=dtype, kv_cache_bytes=256 << 20, max_model_len=MAX_MODEL_LEN
            )
        ), params


def fill(eng, params_cls, batch: int, context: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    for i in range(batch):
        prompt = [rng.randrange(3, eng.model_config.vocab_size) for _ in range(context)]
        eng.add_request(
            f"d{i}",
            prompt,
            params_cls(max_tokens=eng.max_model_len - context, temperature=0, ignore_eos=True),
        )
    while any(s.num_computed_tokens < context for s in eng.seqs.values()):
        eng.step()


def time_decode(eng) -> float:
    for _ in range(SETTLE):
        eng.step()
    start = time.perf_counter()
    for _ in range(STEPS):
        eng.step()
    return (time.perf_counter() - start) / STEPS * 1e3


def time_prefill(eng, params_cls, length: int, rng: random.Random) -> float:
    """One step that prefills a new prompt (alone in the engine), then the request is aborted."""
    prompt = [rng.randrange(3, eng.model_config.vocab_size) for _ in range(length)]
    request_id = f"p{rng.random()}"
    eng.add_request(request_id, prompt, params_cls(max_tokens=1, temperature=0))
    start = time.perf_counter()
    while request_id in eng.seqs:
        eng.step()
    return (time.perf_counter() - start) * 1e3


def report(what: str, times: dict[str, list[float]]) -> None:
    print(f"  {what}")
    for name, values in times.items():
        print(
            f"    {name:13} min {min(values):8.2f} ms  median {statistics.median(values):8.2f} ms"
        )
    ratio = statistics.median(times["working tree"]) / statistics.median(times["baseline"])
    print(f"    working tree / baseline (median): {ratio:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--baseline", default="HEAD", help="git revision whose engine/ is the baseline")
    ap.add_argument("--model", default=os.path.join(REPO_ROOT, "demo", "tandem-demo"))
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument(
        "--prefill", type=int, default=0, help="also time a step prefilling a prompt this long"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"CPU: {cpu_model()} ({platform.machine()}), {torch.get_num_threads()} threads; "
        f"{os.path.basename(os.path.normpath(args.model))}, baseline {args.baseline}"
    )
    for dtype in args.dtypes.split(","):
        print(f"{dtype}:")
        engines = {
            "baseline": build(args.baseline, args.model, dtype),
            "working tree": build(None, args.model, dtype),
        }
        if args.prefill:
            rng = random.Random(1)
            times = {name: [] for name in engines}
            for _ in range(ROUNDS):
                for name, (eng, params) in engines.items():
                    times[name].append(time_prefill(eng, params, args.prefill, rng))
            report(f"prefill of {args.prefill} tokens", times)
        for batch in map(int, args.batches.split(",")):
            for eng, params in engines.values():
                for request_id in list(eng.seqs):
                    eng.abort(request_id)
                fill(eng, params, batch, args.context)
            times = {name: [] for name in engines}
            for _ in range(ROUNDS):
                for name, (eng, _) in engines.items():
                    times[name].append(time_decode(eng))
            report(f"decode, batch {batch}, context ~{args.context}", times)


if __name__ == "__main__":
    main()
