"""`python -m engine.layers.remeasure --model DIR [--dtype D]`: measure the matmul kernels of a
model's weight shapes again (on an idle machine) and store the choices in this machine's cache
(engine/layers/kernel_choice.py), by loading the model once with TANDEM_KERNELS=remeasure."""

from __future__ import annotations

import argparse
import logging

from engine import knobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, help="a Hugging Face model folder")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    knobs.set_kernels("remeasure")
    from engine.config import EngineConfig
    from engine.layers.kernel_choice import cache_path
    from engine.llm_engine import LLMEngine

    LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_bytes=16 << 20))
    print(f"choices stored in {cache_path()}")


if __name__ == "__main__":
    main()
