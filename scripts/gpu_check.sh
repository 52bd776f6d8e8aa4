#!/usr/bin/env bash
# Runs every GPU-only test on one machine with CUDA (the engines on the GPU, the equivalence gate on
# CUDA tensors, KV packing on the device; NCCL pairs when two GPUs are present), then the DeepSeekMoE
# decode benchmark on one GPU (DeepSeekMoE-16B's shapes, random bf16 weights, built on the GPU:
# pdserve's DecodeEngine against model.generate at batch 1, 16 and 64), in under 8 minutes.
# Usage: scripts/gpu_check.sh [PYTEST ARGS]   (from the repository root; creates .venv with a CUDA
# torch build). Exits non-zero when either part fails; the benchmark runs even when a test failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
    || .venv/bin/python -m pip install --quiet "torch>=2.6,<3"
.venv/bin/python -m pip install --quiet -e ".[dev]"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
.venv/bin/python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible'; print(torch.__version__, torch.cuda.get_device_name(0))"
export PDSERVE_LOG_LEVEL=WARNING
status=0
timeout 300 .venv/bin/pytest -q -m gpu -p no:cacheprovider tests/ "$@" || status=$?
timeout 150 .venv/bin/python scripts/bench_moe_decode.py --model deepseek-moe-16b-shape --device cuda:0 \
    --dtype bfloat16 --batch 1,16,64 --input-len 64 --output-len 64 || status=$?
exit "$status"
