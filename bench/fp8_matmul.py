"""FP8 block weights against bf16 in tandem's batch-invariant matmul, side by side in one run.

    .venv/bin/python bench/fp8_matmul.py [--shapes 4096x4096,11008x4096] [--rows 1,16]

Each shape's random weight is quantized to FP8 blocks as DeepSeek-V3 publishes them (e4m3, a
scale per 128 x 128 block) and also kept in bf16; both Linear layers multiply the same bf16
activations, timed in turns (the best of 5 one-second samples). Prints ms per call and the
FP8/bf16 speed ratio (above 1x: FP8 faster).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine.cpu import describe_cpu  # noqa: E402
from engine.layers.fp8 import BLOCK, Fp8BlockWeight  # noqa: E402
from engine.layers.linear import Linear  # noqa: E402


def per_call(fn, seconds: float = 1.0) -> float:
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,11008x4096")
    ap.add_argument("--rows", default="1,16")
    args = ap.parse_args()
    print(f"CPU: {describe_cpu()}; threads: {torch.get_num_threads()}")
    torch.manual_seed(0)
    for shape in args.shapes.split(","):
        out, cols = (int(n) for n in shape.split("x"))
        weight = torch.randn(out, cols)
        scales = torch.rand(-(-out // BLOCK), -(-cols // BLOCK)) * 0.01 + 1e-3
        full = scales.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :cols]
        fp8 = Linear(Fp8BlockWeight((weight / full).clamp(-448, 448).to(torch.float8_e4m3fn), scales, torch.bfloat16))
        bf16 = Linear(weight.bfloat16())
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, cols).bfloat16()
            best = {"bf16": float("inf"), "fp8": float("inf")}
            for _ in range(5):
                best["bf16"] = min(best["bf16"], per_call(lambda: bf16(x)))
                best["fp8"] = min(best["fp8"], per_call(lambda: fp8(x)))
            print(f"{shape} rows {rows}: bf16 {best['bf16'] * 1e3:.2f} ms, fp8 {best['fp8'] * 1e3:.2f} ms, "
                  f"fp8/bf16 speed {best['bf16'] / best['fp8']:.2f}x")


if __name__ == "__main__":
    main()
