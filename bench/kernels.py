"""The batch-invariant kernels (engine/csrc), the working tree against a baseline revision, in one
process, in turns:

    .venv/bin/python bench/kernels.py [--baseline REV] [--marches native,x86-64-v3] [--threads 1,2]
        [--cases TEXT]

REV's engine/csrc (`git archive`) and the working tree's are each built for every --marches
target (native: this CPU; x86-64-v3: what an AVX2-only CPU such as a Zen 3 runs, so an AVX-512
machine can time the other kind's code, if not its cores) under op namespaces of their own, so
all of them load side by side. Shapes are the demo model's (8 query heads on 2 kv heads of 32
dims; 256 hidden, 768 intermediate), fp32:
- attention: 4 prompts of 512 tokens (a step of a wave); 64 sequences at ~600 keys verifying 1
  or 2 draft tokens (tiles of 2 and 3 tokens) and decoding (1 token); long prompts with real
  models' heads (SmolLM2-135M's at 4k tokens, gemma-3-270m's at 8k and 16k, and its sliding
  layers' window of 512 at 8k); then some of those in bf16 with SmolLM2's and gemma3's heads;
- matmuls of a 2,048-token step: gate_up (256 -> 1,536) and down (768 -> 256); and decodes of
  1, 16 and 64 rows on the 125M bench checkpoint's gate_up (768 -> 6,144), whose one or two
  row chunks every thread must share;
- GatedMLP's gate_up and SiLU (invariant_linear_silu where a build has it, else invariant_linear
  then silu_and_mul) for that step and for decodes of 1 and 16 rows of the 125M checkpoint;
- the 125M checkpoint's 512-token prefill matmuls with cold weights (16 copies used in turn, so
  each call reads its weight from memory, as a prefill reads each layer's);
- GGUF matmuls (gguf_linear) of a 2,048-token prefill and a decode row: SmolLM2-135M's Q4_1
  gate_up (576 -> 3,072) and down (1,536 -> 576), a gemma-3-270m-shaped Q8_0 gate_up (640 ->
  4,096); then with bf16 x (bf16 products; a baseline before them widens x to fp32).
Each case alternates the builds 7 times after a warm-up; prints the median ms of each and
tree / baseline (below 1x is faster). The built libraries stay in build/fused.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import subprocess
import tempfile
import time

import torch

from engine.layers import fused
from engine.layers.kernel_choice import cpu_model, invariant_pack

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROUNDS = 7
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 32, 16


def baseline_csrc(rev: str, into: str) -> str:
    archive = subprocess.run(
        ["git", "-C", REPO_ROOT, "archive", rev, "engine/csrc"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return os.path.join(into, "engine", "csrc")


def attention_case(
    num_seqs: int,
    length: int,
    tokens: int | None,
    heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
    window: int = 0,
    dtype=torch.float32,
):
    """`tokens` at the end of each sequence, or (None) whole prompts; heads: query heads, kv
    heads, head dims; window: a sliding window's keys (0: none); dtype: of q and the pages."""
    num_heads, kv_heads, dim = heads
    blocks = num_seqs * length // BLOCK + 8
    k = torch.randn(blocks, BLOCK, kv_heads, dim).to(dtype)
    v = torch.randn(blocks, BLOCK, kv_heads, dim).to(dtype)
    tables = torch.randperm(blocks)[: num_seqs * length // BLOCK].view(num_seqs, -1).contiguous()
    if tokens is None:
        seq = torch.arange(num_seqs).repeat_interleave(length)
        pos = torch.arange(length).repeat(num_seqs)
    else:
        seq = torch.arange(num_seqs).repeat_interleave(tokens)
        pos = torch.arange(length - tokens, length).repeat(num_seqs)
    q = torch.randn(len(seq), num_heads, dim).to(dtype)
    args = (q, k, v, tables.long(), seq, pos, window, dim**-0.5)
    return lambda ops: ops.paged_attention(*args)


def packed_weights(out: int, cols: int, copies: int):
    """`copies` packed weights, handed out in turn: with more than one, each call reads a weight
    the last calls did not (cold, from memory, as a prefill reads each layer's)."""
    weights = itertools.cycle([invariant_pack(torch.randn(out, cols)) for _ in range(copies)])
    return lambda: next(weights)


def linear_case(rows: int, cols: int, out: int, copies: int = 1):
    x, packed = torch.randn(rows, cols), packed_weights(out, cols, copies)
    return lambda ops: ops.invariant_linear(x, packed(), None, out, None)


def gate_up_silu_case(rows: int, cols: int, width: int, copies: int = 1):
    """GatedMLP's gate, up and SiLU: one op where the build has it, else the two."""
    x, packed = torch.randn(rows, cols), packed_weights(2 * width, cols, copies)

    def run(ops):
        if hasattr(ops, "invariant_linear_silu"):
            return ops.invariant_linear_silu(x, packed(), width, None)
        return ops.silu_and_mul(ops.invariant_linear(x, packed(), None, 2 * width, None))

    return run


def gguf_case(rows: int, cols: int, out: int, kind: str, dtype=torch.float32):
    """GGUF blocks (engine/csrc/gguf_linear.cpp) of ggml type `kind`, quantized by gguf-py; x in
    `dtype` (bf16: bf16 products)."""
    import gguf
    import numpy as np

    t = gguf.GGMLQuantizationType[kind]
    w = (np.random.default_rng(0).standard_normal((out, cols)) * 0.05).astype(np.float32)
    raw, x = torch.from_numpy(gguf.quants.quantize(w, t)), torch.randn(rows, cols).to(dtype)
    return lambda ops: ops.gguf_linear(x, [raw], [int(t)], cols)


CASES = {
    "attention, 4 prompts of 512": lambda: attention_case(4, 512, None),
    "attention, 64 x 3 tokens at 600": lambda: attention_case(64, 608, 3),
    "attention, 64 x 2 tokens at 600": lambda: attention_case(64, 608, 2),
    "attention, 64 decodes at 600": lambda: attention_case(64, 608, 1),
    # long prompts: SmolLM2-135M's heads (9 on 3 kv heads of 64), gemma-3-270m's (4 on 1 of 256)
    "attention, a 4k prompt, SmolLM2's heads": lambda: attention_case(1, 4096, None, (9, 3, 64)),
    "attention, a 16k prompt, gemma3's heads": lambda: attention_case(1, 16384, None, (4, 1, 256)),
    "attention, an 8k prompt, gemma3's heads": lambda: attention_case(1, 8192, None, (4, 1, 256)),
    "attention, an 8k prompt, gemma3's window": lambda: attention_case(
        1, 8192, None, (4, 1, 256), window=512
    ),
    # bf16 (bf16 products where a build has them; a baseline before them widens to fp32)
    "attention bf16, 1 decode at 300, SmolLM2's": lambda: attention_case(
        1, 304, 1, (9, 3, 64), dtype=torch.bfloat16
    ),
    "attention bf16, 64 decodes at 600, SmolLM2's": lambda: attention_case(
        64, 608, 1, (9, 3, 64), dtype=torch.bfloat16
    ),
    "attention bf16, 64 x 3 tokens at 600, SmolLM2's": lambda: attention_case(
        64, 608, 3, (9, 3, 64), dtype=torch.bfloat16
    ),
    "attention bf16, a 4k prompt, SmolLM2's heads": lambda: attention_case(
        1, 4096, None, (9, 3, 64), dtype=torch.bfloat16
    ),
    "attention bf16, an 8k prompt, gemma3's heads": lambda: attention_case(
        1, 8192, None, (4, 1, 256), dtype=torch.bfloat16
    ),
    "attention bf16, an 8k prompt, gemma3's window": lambda: attention_case(
        1, 8192, None, (4, 1, 256), window=512, dtype=torch.bfloat16
    ),
    "matmul 2048 x 256 -> 1536": lambda: linear_case(2048, 256, 1536),
    "matmul 2048 x 768 -> 256": lambda: linear_case(2048, 768, 256),
    "gate_up + SiLU 2048 x 256 -> 768": lambda: gate_up_silu_case(2048, 256, 768),
    # decodes (the 125M bench checkpoint's MLP): one row chunk, which every thread must share
    "matmul 1 x 768 -> 6144": lambda: linear_case(1, 768, 6144),
    "matmul 16 x 768 -> 6144": lambda: linear_case(16, 768, 6144),
    "matmul 64 x 768 -> 6144": lambda: linear_case(64, 768, 6144),
    "gate_up + SiLU 1 x 768 -> 3072": lambda: gate_up_silu_case(1, 768, 3072),
    "gate_up + SiLU 16 x 768 -> 3072": lambda: gate_up_silu_case(16, 768, 3072),
    # the 125M checkpoint's 512-token prefill, its weights cold (16 copies in turn)
    "prefill 512 x 768 -> 1280, cold": lambda: linear_case(512, 768, 1280, copies=16),
    "gate_up + SiLU 512 x 768 -> 2048, cold": lambda: gate_up_silu_case(512, 768, 2048, copies=16),
    "prefill 512 x 2048 -> 768, cold": lambda: linear_case(512, 2048, 768, copies=16),
    # GGUF: SmolLM2-135M's Q4_1 gate_up and down, a gemma-3-270m-shaped Q8_0 gate_up
    "gguf Q4_1 2048 x 576 -> 3072": lambda: gguf_case(2048, 576, 3072, "Q4_1"),
    "gguf Q4_1 2048 x 1536 -> 576": lambda: gguf_case(2048, 1536, 576, "Q4_1"),
    "gguf Q8_0 2048 x 640 -> 4096": lambda: gguf_case(2048, 640, 4096, "Q8_0"),
    "gguf Q4_1 64 x 576 -> 3072": lambda: gguf_case(64, 576, 3072, "Q4_1"),
    "gguf Q4_1 1 x 576 -> 3072": lambda: gguf_case(1, 576, 3072, "Q4_1"),
    "gguf Q8_0 1 x 640 -> 4096": lambda: gguf_case(1, 640, 4096, "Q8_0"),
    "gguf Q4_1 2048 x 576 -> 3072, bf16": lambda: gguf_case(
        2048, 576, 3072, "Q4_1", torch.bfloat16
    ),
    "gguf Q4_1 2048 x 1536 -> 576, bf16": lambda: gguf_case(
        2048, 1536, 576, "Q4_1", torch.bfloat16
    ),
    "gguf Q4_1 64 x 576 -> 3072, bf16": lambda: gguf_case(64, 576, 3072, "Q4_1", torch.bfloat16),
    "gguf Q4_1 1 x 576 -> 3072, bf16": lambda: gguf_case(1, 576, 3072, "Q4_1", torch.bfloat16),
    "gguf Q8_0 1 x 640 -> 4096, bf16": lambda: gguf_case(1, 640, 4096, "Q8_0", torch.bfloat16),
}


def timed(run, ops) -> float:
    start = time.perf_counter()
    run(ops)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--baseline", default="HEAD~1", help="git revision of the baseline kernels")
    ap.add_argument("--marches", default="native,x86-64-v3")
    ap.add_argument("--threads", default="1", help="torch threads, each in turn")
    ap.add_argument("--cases", default="", help="only the cases whose names hold this text")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()} ({platform.machine()}); baseline {args.baseline}")
    builds = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = baseline_csrc(args.baseline, tmp)
        for march in args.marches.split(","):
            tag = march.replace("-", "_")
            for who, csrc in (("baseline", base), ("tree", fused.CSRC)):
                namespace = f"tandem_bench_{who}_{tag}"
                torch.ops.load_library(fused.build(march, namespace, csrc))
                builds[(march, who)] = getattr(torch.ops, namespace)
    torch.manual_seed(0)
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        print(
            f"\n{threads} thread(s)                      "
            + "".join(f"{march:>30}" for march in args.marches.split(","))
        )
        print(" " * 42 + "   baseline ms  tree ms  ratio" * len(args.marches.split(",")))
        for name, make in CASES.items():
            if args.cases not in name:
                continue
            run = make()
            line = f"  {name:40}"
            for march in args.marches.split(","):
                pair = {who: builds[(march, who)] for who in ("baseline", "tree")}
                times = {who: [] for who in pair}
                for ops in pair.values():
                    run(ops)  # warm-up
                for _ in range(ROUNDS):
                    for who, ops in pair.items():
                        times[who].append(timed(run, ops))
                b, t = (statistics.median(times[who]) for who in ("baseline", "tree"))
                line += f"   {b:11.2f} {t:8.2f} {t / b:5.2f}x"
            print(line)


if __name__ == "__main__":
    main()
