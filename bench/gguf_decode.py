"""A GGUF model's batch-1 decode step against its floor: the file's bytes over the machine's
measured read bandwidth (bench/membw.py), in the same run. Decode at batch 1 streams every
weight once a step, so the ratio says how far the kernels are from the memory's pace. Beside
it, in turns on the same engine, the step with each layer's Python (no one-op layers:
engine/models/one_op_layer.py), which is what the one op saves.

    .venv/bin/python bench/gguf_decode.py [--model smollm2 | FILE.gguf] [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.gguf_memory import cpu_name
from bench.membw import measure_bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    from engine.config import EngineConfig
    from engine.gguf.folder import model_folder, weight_files
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    folder = model_folder(args.model)
    size = sum(os.path.getsize(f) for f in weight_files(folder))
    engine = LLMEngine(EngineConfig(model=folder, kv_cache_bytes=64 << 20))
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    engine.generate([list(range(100, 164))], SamplingParams(max_tokens=8, temperature=0))  # warm
    layers = engine.runner.model.layers
    one_ops = [layer.one_op for layer in layers]
    steps: dict[bool, list[float]] = {True: [], False: []}
    for round in range(6):  # in turns: the machine's noise falls on both
        one_op = round % 2 == 0
        for layer, op in zip(layers, one_ops):
            layer.one_op = op if one_op else None
        engine.add_request(f"timed{round}", list(range(200, 264)), params)
        engine.step()  # the prefill
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps[one_op].append(time.perf_counter() - t)
    step, python_step = statistics.median(steps[True]), statistics.median(steps[False])
    read = measure_bandwidth()["read_gb_s"] * 1e9
    floor = size / read
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; {os.path.basename(weight_files(folder)[0])}")
    print(
        f"read bandwidth {read / 1e9:.2f} GB/s; the file {size / 1e6:.1f} MB: floor {floor * 1e3:.2f} ms"
    )
    print(
        f"decode step at batch 1, median of {len(steps[True])}: {step * 1e3:.2f} ms, "
        f"{step / floor:.2f}x the floor"
    )
    print(
        f"  with each layer's Python instead (one-op layers: {sum(op is not None for op in one_ops)}"
        f" of {len(layers)}): {python_step * 1e3:.2f} ms, {python_step / step:.2f}x"
    )
    print(f"{1 / step:.1f} tokens/s")


if __name__ == "__main__":
    main()
