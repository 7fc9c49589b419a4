#!/usr/bin/env bash
# The engine on a CUDA GPU, for a session lent one (the device tool runs it in a copy of the
# repo): the golden and batching tests on CUDA, then prefill and decode timings per attention
# backend. Under 10 minutes on an H200.
#
#   bash bench/gpu_check.sh            # the machine's own python3, with torch built for CUDA
#
# The machine has torch, transformers and pytest, but no flashinfer: to test the FlashInfer
# backend too, download its wheel here into .whl/ (the device README says how) and carry it;
# this script installs whatever .whl/ holds. Figures go to stdout and, if $OUT is set, to
# $OUT/gpu_check.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
$PY - <<'EOF'
import torch
assert torch.cuda.is_available(), "no CUDA device"
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
EOF

echo "== golden and batching tests on CUDA (EngineConfig's device auto picks it)"
$PY -m pytest -q -p no:cacheprovider tests/golden tests/unit/test_batching.py 2>&1 | tail -15 || true

echo "== bench checkpoints"
$PY bench/checkpoints.py tiny,small float32,bfloat16 >/dev/null

echo "== prefill 512 tokens and decode steps, median of 5, per attention backend"
$PY - <<'EOF'
import json, os, statistics, time
import torch
from engine.attention import resolve_backend_name
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

def timed(fn, repeats=5):
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize(); start = time.perf_counter(); fn(); torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)

backends = ["torch"] + (["flashinfer"] if resolve_backend_name("auto", torch.device("cuda")) == "flashinfer" else [])
results = []
print(f"{'checkpoint':<16}{'backend':<12}{'prefill 512 ms':>16}{'decode b1 ms':>14}{'decode b16 ms':>15}{'greedy = torch':>16}")
for name in ("tiny-float32", "tiny-bfloat16", "small-float32", "small-bfloat16"):
    folder = f"build/bench-checkpoints/{name}"
    reference = None
    for backend in backends:
        engine = LLMEngine(EngineConfig(model=folder, dtype=name.split("-")[1], device="cuda", attention_backend=backend,
                                        kv_cache_bytes=2 << 30, enable_prefix_caching=False))
        prompt = [(7 * i) % 1000 + 5 for i in range(512)]
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        prefill = timed(lambda: engine.generate([prompt], one))
        row = {"checkpoint": name, "backend": backend, "prefill_512_ms": 1000 * prefill}
        for batch in (1, 16):
            prompts = [[(11 * i + j) % 1000 + 5 for j in range(16)] for i in range(batch)]
            steps = SamplingParams(max_tokens=65, temperature=0, ignore_eos=True)
            first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
            total = timed(lambda: engine.generate(prompts, steps), 3)
            prompt_only = timed(lambda: engine.generate(prompts, first), 3)
            row[f"decode_b{batch}_ms"] = 1000 * (total - prompt_only) / 64
        tokens = engine.generate([prompt[:64]], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0].token_ids
        reference = reference or tokens
        row["greedy_equal"] = tokens == reference
        results.append(row)
        print(f"{name:<16}{backend:<12}{row['prefill_512_ms']:>16.2f}{row['decode_b1_ms']:>14.2f}"
              f"{row['decode_b16_ms']:>15.2f}{str(row['greedy_equal']):>16}")
        del engine
        torch.cuda.empty_cache()
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f, indent=1)
EOF
