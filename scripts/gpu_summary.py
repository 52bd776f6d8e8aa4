"""The one JSON summary of `scripts/gpu_check.sh`: the GPU, every GPU test's outcome, the DeepSeekMoE
decode benchmark against model.generate, and whether everything passed.

The check passes only when every test it requires ran and passed on this machine: those of one GPU
(``ONE_GPU``), and with two GPUs or more also ``TWO_GPUS`` (the DeepEP gate when ``deep_ep`` is
installed). A required test that was skipped, deselected or renamed fails the check as "skipped"
or "missing"; each requirement is a test function, met when every one of its cases passed.

Usage: python scripts/gpu_summary.py RESULTS_DIR [--seconds N] [--min-ratio R] [--gpus N] [--deepep 0|1]
RESULTS_DIR holds junit.xml (pytest) and bench_moe_decode.jsonl (one JSON object per batch size).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ONE_GPU = (
    "tests.test_gpu::test_kv_pack_on_device_round_trips",
    "tests.test_gpu::test_stack_on_cuda_matches_generate",
    "tests.test_gpu::test_a_decode_killed_mid_stream_on_cuda_has_its_streams_continued_exactly",
    "tests.test_gpu::test_expert_parallel_path_on_cuda_tensors",
)
TWO_GPUS = (
    "tests.test_gpu::test_an_nccl_send_nobody_receives_fails_in_bound_and_the_next_generation_works",
    "tests.test_gpu::test_nccl_pair_moves_device_buffers_in_order",
    "tests.test_gpu::test_full_stack_over_nccl",
    "tests.test_gpu::test_a_decode_killed_during_an_nccl_pull_fails_that_pull_only_and_the_prefill_serves_on",
    "tests.test_gpu::test_ep_prefill_group_on_two_gpus",
    "tests.test_kv_transport::test_nccl_pair_moves_cuda_buffers",
    "tests.test_deepep_gpu::test_all_to_all_in_float32_on_two_gpus_is_exact_and_repeats",
)
DEEPEP = ("tests.test_deepep_gpu::test_deepep_ep2_in_bfloat16_against_the_one_process_model",)
RANK = {"passed": 0, "skipped": 1, "missing": 2, "error": 3, "failed": 3}


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


def required(num_gpus: int, deepep: bool) -> tuple[str, ...]:
    """The tests this machine must pass."""
    if num_gpus < 2:
        return ONE_GPU
    return ONE_GPU + TWO_GPUS + (DEEPEP if deepep else ())


def requirements(outcomes: dict[str, str], names: tuple[str, ...]) -> dict[str, str]:
    """Per required test function, the worst outcome of its cases ("missing" when none ran)."""
    met = {}
    for name in names:
        cases = [o for case, o in outcomes.items() if case == name or case.startswith(name + "[")]
        met[name] = max(cases, key=RANK.__getitem__) if cases else "missing"
    return met


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
    parser.add_argument("--gpus", type=int, default=-1, help="GPUs to require tests for (-1: those visible)")
    parser.add_argument(
        "--deepep", type=int, choices=(-1, 0, 1), default=-1, help="-1: whether deep_ep imports"
    )
    args = parser.parse_args()
    names = gpus()
    num_gpus = len(names) if args.gpus < 0 else args.gpus
    deepep = importlib.util.find_spec("deep_ep") is not None if args.deepep < 0 else bool(args.deepep)
    outcomes = tests(args.results / "junit.xml")
    must = requirements(outcomes, required(num_gpus, deepep))
    unmet = sorted(name for name, outcome in must.items() if outcome != "passed")
    rows = bench(args.results / "bench_moe_decode.jsonl")
    largest = max(rows, key=lambda r: r.get("batch", 0)) if rows else {}
    ratio = float(largest.get("speedup", 0.0))
    failed = sorted(name for name, outcome in outcomes.items() if outcome in ("failed", "error"))
    summary = {
        "gpus": names,
        "seconds": args.seconds,
        "tests": {
            "passed": sum(o == "passed" for o in outcomes.values()),
            "skipped": sum(o == "skipped" for o in outcomes.values()),
            "failed": failed,
            "outcomes": outcomes,
            "required": must,
            "unmet": unmet,
        },
        "bench_moe_decode": rows,
        "decode_speedup_at_largest_batch": ratio,
        "ok": not unmet and not failed and bool(rows) and ratio >= args.min_ratio,
    }
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
