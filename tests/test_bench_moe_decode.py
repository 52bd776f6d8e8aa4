"""`scripts/bench_moe_decode.py` on the CPU with the tiny DeepSeekMoE: one quick run, its JSON and table.

The GPU run (DeepSeekMoE-16B's shapes, bfloat16, batch 1/16/64) is part of `scripts/gpu_check.sh`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import REPO_ROOT, service_env

ROW_KEYS = {
    "batch",
    "pdserve_decode_tok_s",
    "pdserve_step_ms",
    "generate_decode_tok_s",
    "generate_step_ms",
    "generate_tok_s",
    "speedup",
    "match",
}


@pytest.mark.timeout(180)
def test_bench_moe_decode_runs_on_cpu_and_matches_generate(cache_dir: Path) -> None:
    argv = [
        sys.executable,
        str(REPO_ROOT / "scripts" / "bench_moe_decode.py"),
        "--model",
        "tiny-deepseek-moe",
        "--device",
        "cpu",
        "--batch",
        "1,3",
        "--input-len",
        "12",
        "--output-len",
        "6",
        "--warmup-tokens",
        "2",
        "--cache-dir",
        str(cache_dir),
        "--json",
    ]
    done = subprocess.run(
        argv, capture_output=True, text=True, env=service_env(cache_dir), cwd=REPO_ROOT, timeout=170
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["model"] == "tiny-deepseek-moe" and result["device"] == "cpu"
    assert result["dtype"] == "float32" and result["parameters"] > 0
    assert (result["input_len"], result["output_len"]) == (12, 6)
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert set(row) == ROW_KEYS
        for key in ROW_KEYS - {"batch", "match"}:
            assert row[key] > 0, (key, row)
        # float32 on the CPU: the engine's greedy tokens are generate's, row for row.
        assert row["match"] == row["batch"], row
    # The table goes to stderr when stdout carries the JSON: one line per batch size.
    table = [line for line in done.stderr.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in table] == ["batch", "1", "3"]
