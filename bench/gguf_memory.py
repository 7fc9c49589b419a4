"""What a served GGUF model keeps resident, against the file's size: the engine's weights (views
of the file's mapping, and the rows it had to copy), the file's pages resident once it has
served, and the heap its load left. Prints the ratios; the CPU beside them.

    .venv/bin/python bench/gguf_memory.py [--model smollm2 | FILE.gguf]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform
import re

import torch


def anonymous() -> int:
    rollup = open("/proc/self/smaps_rollup").read()
    return int(re.search(r"^Anonymous:\s+(\d+)", rollup, re.M).group(1)) * 1024


def resident_pages(path: str) -> int:
    """Bytes of `path`'s mappings resident in this process."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    from engine.config import EngineConfig, ModelConfig
    from engine.gguf.folder import model_folder, weight_files
    from engine.layers import fused  # noqa: F401 (the ops library, loaded before the baseline)
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer

    folder = model_folder(args.model)
    [path] = weight_files(folder)[:1]
    size = sum(os.path.getsize(f) for f in weight_files(folder))
    ModelConfig.from_folder(folder)
    torch.ones(1) @ torch.ones(1)
    start = anonymous()
    Tokenizer(folder)  # what the engine's own tokenizer costs again: not the weights'
    tokenizer = anonymous() - start
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = anonymous()
    engine = LLMEngine(EngineConfig(model=folder, kv_cache_bytes=16 << 20))
    engine.generate([list(range(100, 300))], SamplingParams(max_tokens=16, temperature=0))
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    held = sum(engine.rank_weight_bytes)
    pages = resident_pages(path)
    heap = anonymous() - before - tokenizer
    mib = 1 << 20
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; {os.path.basename(path)}: {size / mib:.1f} MiB")
    print(f"weights the engine holds  {held / mib:7.1f} MiB  {held / size:.2f}x the file")
    print(f"file pages resident       {pages / mib:7.1f} MiB  {pages / size:.2f}x")
    print(f"the tokenizer             {tokenizer / mib:7.1f} MiB  (not counted below)")
    print(f"heap grown by the load    {heap / mib:7.1f} MiB  (copied rows, the KV pages used,")
    print("                                       gguf-py's parsed metadata, the engine's state)")
    print(
        f"resident, all of it       {(pages + heap) / mib:7.1f} MiB  {(pages + heap) / size:.2f}x"
    )


if __name__ == "__main__":
    main()
