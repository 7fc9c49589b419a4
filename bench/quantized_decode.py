"""Decode of one checkpoint in bf16 and as Kimi K2 (FP8 blocks) and K2.5 (INT4 experts) publish
it, interleaved in one process, each step against its bandwidth floor:

    .venv/bin/python bench/quantized_decode.py [--checkpoint kimi] [--variants bfloat16,fp8,int4]
                                               [--batches 1,16] [--context 16] [--rounds 8]

The variants' engines are built side by side (bench/checkpoints.py writes the folders); each
gets the same `batch` sequences, then rounds alternate between them, each round measuring the
read bandwidth (bench/membw.py) and timing every variant's decode steps (bench/decode_step.py's
settle-then-time). Separate runs of one variant swing by 20-50% on a shared VM, which is what
made bench/engine_speed.py's sequential quantized/bf16 ratios move from 1.06x to 1.8x between runs;
in turns, the machine's state is shared. Prints each variant's best and median ms per step,
the median ratio to the first variant, and each round's mean step against its floor (the
weight bytes a step reads, bench/checkpoints.decode_weight_bytes, over that round's read
bandwidth): the median and best of those ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch

from bench.checkpoints import compute_dtype, decode_weight_bytes, make_checkpoint
from bench.decode_step import fill, time_decode
from bench.membw import measure_bandwidth
from engine.config import EngineConfig
from engine.layers.kernel_choice import cpu_model
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkpoint", default="kimi")
    ap.add_argument("--variants", default="bfloat16,fp8,int4")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    variants = args.variants.split(",")
    folders = {v: make_checkpoint(args.checkpoint, v) for v in variants}
    engines = {
        v: LLMEngine(
            EngineConfig(
                model=folders[v],
                dtype=compute_dtype(v),
                kv_cache_bytes=256 << 20,
                max_model_len=1024,
            )
        )
        for v in variants
    }
    step_bytes = {v: decode_weight_bytes(folders[v]) for v in variants}
    print(
        f"CPU: {cpu_model()} ({platform.machine()}), {torch.get_num_threads()} threads; {args.checkpoint}, "
        f"{args.rounds} rounds in turns"
    )
    base = variants[0]
    for batch in map(int, args.batches.split(",")):
        for eng in engines.values():
            for request_id in list(eng.seqs):
                eng.abort(request_id)
            fill(eng, SamplingParams, batch, args.context)
        times, reads = {v: [] for v in variants}, []
        for _ in range(args.rounds):
            reads.append(measure_bandwidth(size_gib=0.5, repeats=2)["read_gb_s"])
            for v, eng in engines.items():
                times[v].append(time_decode(eng))
        print(
            f"decode, batch {batch} (read bandwidth a round: median {statistics.median(reads):.1f}, "
            f"{min(reads):.1f}-{max(reads):.1f} GB/s)"
        )
        for v in variants:
            best, median = min(times[v]), statistics.median(times[v])
            line = (
                f"  {v:9} best {best:7.2f} ms  median {median:7.2f} ms  {batch * 1e3 / median:7.1f} tok/s  "
                f"{statistics.median(times[base]) / median:.2f}x {base}"
            )
            if batch == 1:
                # Each round's steps against the floor at that round's bandwidth: the machine's
                # bandwidth swings between rounds (45-80 GB/s on a shared VM), so a step and a
                # read taken rounds apart compare different machines.
                ratios = [t / (step_bytes[v] / (r * 1e9) * 1e3) for t, r in zip(times[v], reads)]
                line += (
                    f"  vs its floor ({step_bytes[v] / 1e6:.0f} MB a step): median "
                    f"{statistics.median(ratios):.2f}x, best {min(ratios):.2f}x"
                )
            print(line)
        if batch == 1:
            print(
                "  "
                + ", ".join(
                    f"{v}'s bytes allow {step_bytes[base] / step_bytes[v]:.2f}x"
                    for v in variants[1:]
                )
            )


if __name__ == "__main__":
    main()
