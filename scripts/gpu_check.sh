#!/usr/bin/env bash
# Runs every GPU-only test on one machine with CUDA (the engines on the GPU, the equivalence gate on
# CUDA tensors, KV packing on the device; NCCL pairs when two GPUs are present), in under 8 minutes.
# Usage: scripts/gpu_check.sh   (from the repository root; creates .venv with a CUDA torch build)
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
timeout 480 .venv/bin/pytest -q -m gpu -p no:cacheprovider tests/ "$@"
