"""Engine step time, the working tree against a baseline revision of the attention backend,
interleaved in one process (so both see the same machine state):

    .venv/bin/python bench/decode_step.py --baseline REV [--model demo/tandem-demo]
                                          [--batch 12] [--context 600] [--threads 1]

Loads REV's engine/attention/torch_backend.py beside the working tree's, fills a batch of
`--batch` sequences to `--context` tokens, then alternates the two implementations: 6 rounds
of 20 decode steps each. Prints min and median ms per step and the ratio. On this machine,
separate runs of the same code differ by 20-30%; interleaving is what makes a 10% change
visible.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402

from engine.attention import torch_backend  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

BACKEND_FILE = "engine/attention/torch_backend.py"
METHODS = ("plan", "_plan_group", "forward", "_attend")


def baseline_backend(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:{BACKEND_FILE}"], cwd=REPO_ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "baseline_torch_backend.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("baseline_torch_backend", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="git revision whose attention backend is the baseline")
    ap.add_argument("--model", default=os.path.join(REPO_ROOT, "demo", "tandem-demo"))
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = baseline_backend(args.baseline)
    impls = {name: {m: getattr(cls, m) for m in METHODS}
             for name, cls in (("baseline", base.TorchBackend), ("working tree", torch_backend.TorchBackend))}
    # All four together: a baseline's plan may build metadata its own forward expects.
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_bytes=512 << 20))
    rng = random.Random(0)
    max_tokens = engine.max_model_len - args.context
    for i in range(args.batch):
        prompt = [rng.randrange(3, engine.model_config.vocab_size) for _ in range(args.context)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while any(s.num_computed_tokens < args.context for s in engine.seqs.values()):
        engine.step()
    times = {name: [] for name in impls}
    for _ in range(6):
        for name, methods in impls.items():
            for method, fn in methods.items():
                setattr(torch_backend.TorchBackend, method, fn)
            for _ in range(3):  # settle
                engine.step()
            t0 = time.perf_counter()
            for _ in range(20):
                engine.step()
            times[name].append((time.perf_counter() - t0) / 20 * 1e3)
    print(f"{os.path.basename(args.model)}, batch {args.batch}, context ~{args.context}, {args.threads} thread(s)")
    for name, values in times.items():
        print(f"  {name:13} min {min(values):6.2f} ms  median {statistics.median(values):6.2f} ms per step")
    ratio = statistics.median(times["working tree"]) / statistics.median(times["baseline"])
    print(f"  working tree / baseline (median): {ratio:.2f}x")


if __name__ == "__main__":
    main()
