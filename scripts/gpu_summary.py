"""The one JSON summary of `scripts/gpu_check.sh`: the GPU, every GPU test's outcome, the DeepSeekMoE
decode benchmark against model.generate, and whether everything passed.

Usage: python scripts/gpu_summary.py RESULTS_DIR [--seconds N] [--min-ratio R]
RESULTS_DIR holds junit.xml (pytest) and bench_moe_decode.jsonl (one JSON object per batch size).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any


def tests(junit: Path) -> dict[str, str]:
    """Outcome of every test case: passed, failed, error or skipped."""
    if not junit.exists():
        return {}
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
        outcomes[name] = {"failure": "failed"}.get(outcome, outcome)
    return outcomes


def bench(lines: Path) -> list[dict[str, Any]]:
    if not lines.exists():
        return []
    return [json.loads(line) for line in lines.read_text().splitlines() if line.startswith("{")]


def gpus() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=Path)
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument(
        "--min-ratio", type=float, default=3.0, help="pdserve / generate at the largest batch"
    )
    args = parser.parse_args()
    outcomes = tests(args.results / "junit.xml")
    rows = bench(args.results / "bench_moe_decode.jsonl")
    largest = max(rows, key=lambda r: r.get("batch", 0)) if rows else {}
    ratio = float(largest.get("speedup", 0.0))
    failed = sorted(name for name, outcome in outcomes.items() if outcome in ("failed", "error"))
    summary = {
        "gpus": gpus(),
        "seconds": args.seconds,
        "tests": {
            "passed": sum(o == "passed" for o in outcomes.values()),
            "skipped": sum(o == "skipped" for o in outcomes.values()),
            "failed": failed,
            "outcomes": outcomes,
        },
        "bench_moe_decode": rows,
        "decode_speedup_at_largest_batch": ratio,
        "ok": bool(outcomes) and not failed and bool(rows) and ratio >= args.min_ratio,
    }
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
