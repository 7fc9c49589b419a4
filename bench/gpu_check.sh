#!/usr/bin/env bash
# The engine on a CUDA GPU, for a session lent one (the device tool runs it in a copy of the
# repo): the golden, batching, CUDA-graph and Triton-kernel tests on CUDA, then
# bench/gpu_check.py (eager against decode CUDA graphs, side by side; then an 8B Llama and a
# Kimi-shaped mixture of experts in bf16, FP8 and INT4 against the bandwidth floor). About 7-10
# minutes on an H200: run it with a timeout of 600 s. Dry-run on CPU: python bench/gpu_check.py --device cpu --dry
#
#   bash bench/gpu_check.sh            # the machine's own python3, with torch built for CUDA
#
# The machine has torch, transformers and pytest but no flashinfer; wheels carried in .whl/
# are installed first (the device README says how to fetch them). Figures go to stdout and,
# if $OUT is set, to $OUT/gpu_check.json and $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-/tmp}
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
{
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
$PY -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name(), "torch", torch.__version__)' || exit 1

echo "== golden, batching, CUDA-graph and Triton-kernel tests on CUDA (EngineConfig's device auto picks it)"
timeout 300 $PY -m pytest -q -p no:cacheprovider --no-header -rfE tests/golden tests/unit/test_batching.py \
    tests/unit/test_cuda_graphs.py tests/unit/test_triton_kernels.py 2>&1 | tail -25

echo "== eager against decode CUDA graphs; bandwidth-bound shapes against their floor"
timeout 330 $PY bench/gpu_check.py --repeats 3 --json "$OUT/gpu_check.json"
} 2>&1 | tee "$OUT/gpu_check.log"
