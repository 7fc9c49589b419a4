"""The engine on a CUDA GPU, in one process: eager against decode CUDA graphs, and models big
enough to be bound by the device's bandwidth against that floor.

Small checkpoints (`--checkpoints`): per checkpoint and dtype, both engines are loaded side by
side and each figure alternates between them: prefill of 512 tokens, decode step time at batch
1, 16 and 64, greedy tokens (which must be equal), the graphs' capture time, and the device's
share of a batch-1 graphed step (its replay, timed with CUDA events).

Bandwidth-bound shapes (`--shapes`, bench/device_models.py: an 8B Llama and a Kimi-shaped
mixture of experts, random weights made on the device, in bf16, FP8 blocks and INT4 groups
kept quantized): Triton's paged decode attention and quantized matmul (engine/triton), ready
time, prefill, the batch-1 step against its floor, tokens per second at batch 64, eager and in
graphs (greedy equal; the mixture of experts through engine/triton/fused_moe.py).

The floor of a batch-1 step is one read of the bytes it needs at the device copy's rate (bytes
read plus written a second, measured in the same run: a pure read streams at least as fast).
Until 2026-12-02 the small checkpoints' floor took half that rate (twice as lenient).

    python bench/gpu_check.py [--checkpoints tiny,small] [--dtypes float32,bfloat16]
                              [--shapes llama-8b,kimi-moe] [--kinds bfloat16,fp8,int4] [--json F]

bench/gpu_check.sh runs this after the CUDA tests; `--device cpu --dry` dry-runs it (no graphs,
torch attention, every shape cut small).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from bench.checkpoints import make_checkpoint
from bench.device_models import KINDS, SHAPES, decode_bytes, model_folder, random_weights
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

MODES = ("eager", "graphs")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy (median of 5)."""
    src = torch.randn(1 << 28, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times[1:])


def alternating(fns: dict[str, callable], device: str, repeats: int) -> dict[str, float]:
    """Median seconds of each fn, run in turns after one warm-up each."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def replay_ms(engine: LLMEngine, steps: SamplingParams) -> float:
    """The device's time in a batch-1 decode step's graph replay (CUDA events, median): the rest
    of the step is the host's (scheduling, staging, sampling, reading the token back)."""
    graphs = engine.runner.graphs
    replay, events = graphs.replay, []

    def timed(step):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        logits = replay(step)
        end.record()
        events.append((start, end))
        return logits

    graphs.replay = timed
    try:
        engine.generate([[5, 6, 7, 8]], steps)
    finally:
        graphs.replay = replay
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def host_profile(engine: LLMEngine, steps: SamplingParams, top: int = 15) -> None:
    """Where a batch-1 decode's host time goes (cProfile, by own time)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    engine.generate([[5, 6, 7, 8]], steps)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


PROMPT = [(7 * i) % 1000 + 5 for i in range(512)]


def time_steps(
    engines: dict[str, LLMEngine], device: str, repeats: int, batches: tuple[int, ...]
) -> dict[str, dict[str, float]]:
    """Per engine, in turns: a 512-token prefill and the decode step at each batch size (ms)."""
    rows = {mode: {} for mode in engines}
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    steps = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    for mode, secs in alternating(
        {m: (lambda e=e: e.generate([PROMPT], one)) for m, e in engines.items()}, device, repeats
    ).items():
        rows[mode]["prefill_512_ms"] = 1000 * secs
    for batch in batches:
        prompts = [[(11 * i + j) % 1000 + 5 for j in range(16)] for i in range(batch)]
        total = alternating(
            {m: (lambda e=e: e.generate(prompts, steps)) for m, e in engines.items()},
            device,
            repeats,
        )
        first = alternating(
            {m: (lambda e=e: e.generate(prompts, one)) for m, e in engines.items()}, device, repeats
        )
        for mode in engines:
            rows[mode][f"decode_b{batch}_ms"] = 1000 * (total[mode] - first[mode]) / 32
    return rows


def greedy_equal(engines: dict[str, LLMEngine]) -> dict[str, bool]:
    """Whether each engine's greedy tokens equal the first one's."""
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = [PROMPT[:64], PROMPT[100:103], PROMPT[200:390]]
    tokens = {
        mode: [c.token_ids for c in engine.generate(prompts, greedy)]
        for mode, engine in engines.items()
    }
    first = next(iter(tokens.values()))
    return {mode: t == first for mode, t in tokens.items()}


def measure(name: str, dtype: str, device: str, repeats: int, profile: bool = False) -> list[dict]:
    folder = make_checkpoint(name, dtype)
    engines = {
        mode: LLMEngine(
            EngineConfig(
                model=folder,
                dtype=dtype,
                device=device,
                attention_backend="torch",
                kv_cache_bytes=2 << 30,
                enable_prefix_caching=False,
                max_num_seqs=64,
                enforce_eager=mode == "eager",
            )
        )
        for mode in MODES
    }
    rows = {mode: {"checkpoint": f"{name}-{dtype}", "mode": mode} for mode in MODES}
    for mode, figures in time_steps(engines, device, repeats, (1, 16, 64)).items():
        rows[mode].update(figures)
    steps = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    if device == "cuda" and engines["graphs"].runner.graphs is not None:
        rows["graphs"]["b1_replay_ms"] = replay_ms(engines["graphs"], steps)
    if profile:
        host_profile(engines["graphs"], steps)
    equal = greedy_equal(engines)
    graphs = engines["graphs"].runner.graphs
    for mode in MODES:
        rows[mode]["greedy_equal"] = equal[mode]
    rows["graphs"]["graphs"] = len(graphs.graphs) if graphs else 0
    rows["graphs"]["capture_s"] = graphs.capture_seconds if graphs else 0.0
    weight_bytes = sum(
        os.path.getsize(os.path.join(folder, f))
        for f in os.listdir(folder)
        if f.endswith(".safetensors")
    )
    for engine in engines.values():
        engine.close()
    return [dict(rows[mode], weight_bytes=weight_bytes) for mode in MODES]


def measure_shape(shape: str, kind: str, device: str, repeats: int, dry: bool) -> list[dict]:
    """A bandwidth-bound shape in one weight kind: its engines (the weights made once, shared)."""
    folder = model_folder(shape, kind, dry)
    weights = random_weights(shape, kind, torch.device(device), dry)
    read_bytes = decode_bytes(weights, folder)
    engines, ready = {}, {}
    for mode in MODES:
        sync(device)
        started = time.perf_counter()
        engines[mode] = LLMEngine(
            EngineConfig(
                model=folder,
                dtype="bfloat16",
                device=device,
                attention_backend="triton" if device == "cuda" else "torch",
                kv_cache_bytes=(256 << 20) if dry else (4 << 30),
                enable_prefix_caching=False,
                max_num_seqs=64,
                max_model_len=2048,
                enforce_eager=mode == "eager",
            ),
            weights,
        )
        sync(device)
        ready[mode] = time.perf_counter() - started
    del weights  # what the engines use, they hold
    rows = time_steps(engines, device, repeats, (1, 64))
    equal = greedy_equal(engines)
    out = []
    for mode, engine in engines.items():
        out.append(
            dict(
                rows[mode],
                shape=f"{shape}-{kind}",
                mode=mode,
                ready_s=ready[mode],
                resident_bytes=engine.model.weight_bytes,
                read_bytes=read_bytes,
                greedy_equal=equal[mode],
            )
        )
        engine.close()
    return out


def print_shapes(results: list[dict], bandwidth: float) -> None:
    print(
        f"\n{'shape':<20}{'mode':<8}{'weights MB':>11}{'read MB':>9}{'ready s':>9}"
        f"{'prefill512 ms':>14}{'b1 ms':>9}{'b1 floor ms':>12}{'b1/floor':>9}{'b64 ms':>9}"
        f"{'b64 tok/s':>10}{'greedy=':>8}"
    )
    for row in results:
        floor_ms = 1000 * row["read_bytes"] / bandwidth  # read once a step
        row["b1_floor_ms"] = floor_ms
        print(
            f"{row['shape']:<20}{row['mode']:<8}{row['resident_bytes'] / 1e6:>11,.0f}"
            f"{row['read_bytes'] / 1e6:>9,.0f}{row['ready_s']:>9.1f}{row['prefill_512_ms']:>14.1f}"
            f"{row['decode_b1_ms']:>9.3f}{floor_ms:>12.3f}{row['decode_b1_ms'] / floor_ms:>8.2f}x"
            f"{row['decode_b64_ms']:>9.3f}{64000 / row['decode_b64_ms']:>10.0f}"
            f"{str(row['greedy_equal']):>8}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--checkpoints", default="tiny,small")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help="bandwidth-bound shapes ('' for none)"
    )
    parser.add_argument("--kinds", default=",".join(KINDS), help="their weight kinds")
    parser.add_argument("--dry", action="store_true", help="every shape cut small (a CPU run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile a batch-1 decode of each graphs engine"
    )
    args = parser.parse_args()
    device = args.device
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    bandwidth = copy_bandwidth(device)
    print(
        f"{name}, torch {torch.__version__}, device copy {bandwidth / 1e9:.0f} GB/s (read + write)"
    )
    results = []
    head = (
        f"{'checkpoint':<16}{'mode':<8}{'prefill512 ms':>14}{'b1 ms':>8}{'b16 ms':>8}{'b64 ms':>8}"
        f"{'b1 floor ms':>12}{'greedy=':>8}{'graphs':>7}{'capture s':>10}{'b1 replay ms':>13}"
    )
    print(head)
    for checkpoint in filter(None, args.checkpoints.split(",")):
        for dtype in args.dtypes.split(","):
            for row in measure(checkpoint, dtype, device, args.repeats, args.profile):
                floor_ms = 1000 * row["weight_bytes"] / bandwidth  # weights read once a step
                row["b1_floor_ms"] = floor_ms
                results.append(row)
                print(
                    f"{row['checkpoint']:<16}{row['mode']:<8}{row['prefill_512_ms']:>14.2f}"
                    f"{row['decode_b1_ms']:>8.3f}{row['decode_b16_ms']:>8.3f}{row['decode_b64_ms']:>8.3f}"
                    f"{floor_ms:>12.3f}{str(row['greedy_equal']):>8}{row.get('graphs', ''):>7}"
                    f"{row.get('capture_s', ''):>10.4}{row.get('b1_replay_ms', ''):>13.4}",
                    flush=True,
                )
    if results:
        print("\ngraphs / eager speed (eager ms / graphs ms):")
    for eager, graphs in zip(results[::2], results[1::2]):
        ratios = "  ".join(
            f"{key[7:-3]} {eager[key] / graphs[key]:.2f}x"
            for key in ("decode_b1_ms", "decode_b16_ms", "decode_b64_ms")
        )
        print(f"  {eager['checkpoint']:<16}{ratios}")
    shapes = [
        row
        for shape in filter(None, args.shapes.split(","))
        for kind in args.kinds.split(",")
        for row in measure_shape(shape, kind, device, args.repeats, args.dry)
    ]
    if shapes:
        print_shapes(shapes, bandwidth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "copy_bandwidth": bandwidth,
                    "results": results,
                    "shapes": shapes,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
