"""Quantized weights against bf16 in tandem's batch-invariant matmul, side by side in one run.

    .venv/bin/python bench/quantized_matmul.py [--shapes 4096x4096,11008x4096] [--rows 1,16] [--gib 2]

Each shape's random weight is quantized as the seeds' family publishes it: FP8 blocks
(DeepSeek-V3, Kimi K2: e4m3, a scale per 128 x 128 block) and INT4 groups (Kimi K2-Thinking,
K2.5: compressed-tensors pack-quantized, a bf16 scale per 32 weights); a bf16 copy is the
baseline. Each format gets enough layers of the shape (`--gib` of bf16 in all) that they do not
fit the CPU's caches, and a call runs them all, as a decode step reads every weight once from
memory. The three formats multiply the same bf16 activations, timed in turns (the best of 5
samples of at least a second). Prints ms per layer, each format's speed over bf16 (above 1x:
faster) and, at one row, the effective bandwidth (the weights' bytes over the time).
"""

from __future__ import annotations

import argparse
import time

import torch

from engine.cpu import describe_cpu
from engine.layers.linear import Linear
from engine.layers.quantized import num_bytes
from engine.layers.quantized.fp8 import BLOCK, Fp8BlockWeight
from engine.layers.quantized.int4 import Int4GroupWeight

INT4_GROUP = 32


def per_call(fn, seconds: float = 1.0) -> float:
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def fp8_weight(weight: torch.Tensor) -> Fp8BlockWeight:
    out, cols = weight.shape
    scales = torch.rand(-(-out // BLOCK), -(-cols // BLOCK)) * 0.01 + 1e-3
    full = scales.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :cols]
    return Fp8BlockWeight(
        (weight / full).clamp(-448, 448).to(torch.float8_e4m3fn), scales, torch.bfloat16
    )


def int4_weight(weight: torch.Tensor) -> Int4GroupWeight:
    out, cols = weight.shape
    values = torch.randint(0, 16, (out, cols), dtype=torch.uint8)
    packed = values[:, 0::2] | (values[:, 1::2] << 4)
    return Int4GroupWeight(
        packed, (torch.rand(out, cols // INT4_GROUP) * 0.01 + 1e-3).bfloat16(), torch.bfloat16
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,11008x4096")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument(
        "--gib", type=float, default=2.0, help="bf16 bytes of each shape's layers, in GiB"
    )
    args = ap.parse_args()
    print(f"CPU: {describe_cpu()}; threads: {torch.get_num_threads()}")
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        out, cols = (int(n) for n in shape.split("x"))
        count = max(1, int(args.gib * 2**30 / (out * cols * 2)))
        layers, bytes_read = (
            {"bf16": [], "fp8": [], "int4": []},
            dict.fromkeys(("bf16", "fp8", "int4"), 0),
        )
        for _ in range(count):
            weight = torch.randn(out, cols)
            for name, w in (
                ("bf16", weight.bfloat16()),
                ("fp8", fp8_weight(weight)),
                ("int4", int4_weight(weight)),
            ):
                layers[name].append(Linear(w))
                bytes_read[name] += num_bytes(w)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, cols).bfloat16()
            best = dict.fromkeys(layers, float("inf"))
            for _ in range(5):
                for name, stack in layers.items():
                    best[name] = min(
                        best[name], per_call(lambda: [layer(x) for layer in stack]) / count
                    )
            line = ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in best.items())
            ratios = ", ".join(
                f"{name}/bf16 {best['bf16'] / best[name]:.2f}x" for name in ("fp8", "int4")
            )
            bandwidth = (
                ", ".join(
                    f"{name} {bytes_read[name] / count / best[name] / 1e9:.1f} GB/s"
                    for name in best
                )
                if rows == 1
                else ""
            )
            print(
                f"{shape} x {count} layers, rows {rows}: {line} a layer; speed {ratios}"
                + (f"; weight bytes read {bandwidth}" if bandwidth else "")
            )


if __name__ == "__main__":
    main()
