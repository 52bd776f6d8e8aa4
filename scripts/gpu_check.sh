#!/usr/bin/env bash
# The GPU check: every GPU-only test and the DeepSeekMoE decode benchmark on the GPUs of this machine,
# in under 8 minutes on one GPU, ending in one JSON summary.
#
# On one GPU: the engines, KV packing on the device, the three-process stack on that GPU with the KV
# read in place over CUDA IPC (and staged over gloo), exact against model.generate in float32 on
# every preset; a prefill and two decodes on that GPU over CUDA IPC with one decode killed -9
# mid-stream, every stream continued on the other decode token for token; EP on CUDA tensors in a
# group of one; the DeepSeekMoE-16B-shape decode benchmark at batch 1, 16 and 64 against
# model.generate (target: >= 3x at 64). With two GPUs or more, also: NCCL pairs and their failure
# path, the stack over NCCL, an EP=2 prefill group, and the EP=2 DeepEP / all-to-all gates in
# bfloat16 and float32 against the one-process reference.
#
# The summary (scripts/gpu_summary.py) passes only when every test required for this machine's GPU
# count passed: a skipped or missing one fails it. Time: pytest is stopped at 330 s (SIGINT, so its
# report of what ran is still written) and the benchmark at 120 s, under 8 minutes in all once the
# environment exists.
#
# Usage: scripts/gpu_check.sh [PYTEST ARGS]   (from anywhere; writes $OUT/gpu-check/ or ./gpu-check/)
# The Python it runs: .venv when its torch sees a GPU; else a CUDA environment of its own,
# `.venv-gpu`, left in place for the next run: on top of the system python3 when that one's torch
# sees a GPU, otherwise a fresh venv with a CUDA build of torch (from download.pytorch.org, else
# PyPI's Linux wheels). Its other packages come from PyPI, or, on a machine without a network, from
# the wheels in ./.whl/ (installed as they are, without resolving; the project itself then goes on
# the path from this checkout). A CPU torch in .venv (2.13.0+cpu, what `make` installs on CPU
# machines) is never upgraded in place: pip ranks 2.13.0+cpu above PyPI's 2.13.0, so
# `pip install --upgrade torch` there does nothing.
#
# Only the test files holding GPU tests are collected (the others need development tools a GPU
# machine may lack). Each service's log of the run is kept in the results as service-logs.tgz.
sees_gpu() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

purelib() { "$1" -c "import sysconfig; print(sysconfig.get_path('purelib'))"; }

venv_over() {  # $1: a python whose packages (its torch) the venv $2 sees beneath its own
    "$1" -m venv --system-site-packages "$2" || return 1
    # That python may itself be a venv (GPU images ship one), whose packages a venv made from it
    # does not see: its site directories go on the new venv's path, after the venv's own.
    "$1" -c "import site; print('\n'.join(site.getsitepackages()))" > "$(purelib "$2/bin/python")/machine-python.pth"
}

install_project() {  # $1: python of a venv whose torch is to be kept
    if [ -d .whl ]; then
        "$1" -m pip install --quiet --no-index --no-deps --no-compile .whl/*.whl || return 1
        echo "$PWD" > "$(purelib "$1")/pdserve-checkout.pth"
        return
    fi
    local torch_now
    torch_now=$("$1" -c "import torch; print(torch.__version__.split('+')[0])")
    "$1" -m pip install --quiet -e ".[dev]" "torch==${torch_now}" || "$1" -m pip install --quiet --no-deps -e .
}

[[ "${BASH_SOURCE[0]}" == "$0" ]] || return 0  # sourced (the tests): the functions only

set -uo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
results="${OUT:-.}/gpu-check"
mkdir -p "$results"

PY=""
if [ -x .venv/bin/python ] && sees_gpu .venv/bin/python; then
    PY=.venv/bin/python
elif [ -x .venv-gpu/bin/python ] && sees_gpu .venv-gpu/bin/python; then
    PY=.venv-gpu/bin/python
else
    rm -rf .venv-gpu
    if command -v python3 >/dev/null && sees_gpu python3; then
        venv_over python3 .venv-gpu
    else
        python3 -m venv .venv-gpu
        .venv-gpu/bin/python -m pip install --quiet "torch>=2.6,<3" --index-url https://download.pytorch.org/whl/cu130 \
            || .venv-gpu/bin/python -m pip install --quiet "torch>=2.6,<3"
    fi
    install_project .venv-gpu/bin/python
    PY=.venv-gpu/bin/python
fi
if ! sees_gpu "$PY"; then
    echo "{\"ok\": false, \"error\": \"no CUDA device visible to $PY\"}" | tee "$results/summary.json"
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
export PDSERVE_LOG_LEVEL=WARNING PYTHONUNBUFFERED=1

status=0
# The quick files first, the stacks of tests/test_gpu.py last.
mapfile -t gpu_tests < <(grep -l -E "NEEDS_CUDA|ON_CPU_AND_CUDA|mark\.gpu" tests/test_*.py | grep -v "^tests/test_gpu.py$")
gpu_tests+=(tests/test_gpu.py)
basetemp=$(mktemp -d)
timeout -s INT -k 30 330 "$PY" -m pytest -q -m gpu -p no:cacheprovider --junitxml="$results/junit.xml" \
    -o junit_logging=no --basetemp="$basetemp" "${gpu_tests[@]}" "$@" | tee "$results/pytest.log" || status=1
(cd "$basetemp" && find . -name "*.log" -print0 | tar czf "$results/service-logs.tgz" --null -T -) || true
timeout 120 "$PY" scripts/bench_moe_decode.py --model deepseek-moe-16b-shape --device cuda:0 \
    --dtype bfloat16 --batch 1,16,64 --input-len 64 --output-len 64 --json \
    > "$results/bench_moe_decode.jsonl" 2> >(tee "$results/bench.log" >&2) || status=1
"$PY" scripts/gpu_summary.py "$results" --seconds "$(( $(date +%s) - started ))" --min-ratio 3.0 \
    | tee "$results/summary.json" || status=1
exit "$status"
