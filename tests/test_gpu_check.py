"""The GPU check's own pieces that run anywhere: the script parses, and its summary reads pytest's
report and the benchmark's lines into one verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.stack import REPO_ROOT

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_gpu" name="test_a"/>
<testcase classname="tests.test_gpu" name="test_b"><skipped message="two GPUs"/></testcase>
{failed}
</testsuite></testsuites>"""


def _summary(tmp_path: Path, failed: str, speedup: float) -> tuple[int, dict[str, object]]:
    (tmp_path / "junit.xml").write_text(JUNIT.format(failed=failed))
    rows = [{"batch": 1, "speedup": 1.2}, {"batch": 64, "speedup": speedup}]
    (tmp_path / "bench_moe_decode.jsonl").write_text(
        "noise\n" + "\n".join(json.dumps(r) for r in rows) + "\n"
    )
    done = subprocess.run(
        [sys.executable, "scripts/gpu_summary.py", str(tmp_path), "--seconds", "12"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, json.loads(done.stdout)


def test_the_script_parses() -> None:
    assert (
        subprocess.run(["bash", "-n", str(REPO_ROOT / "scripts/gpu_check.sh")], check=False).returncode == 0
    )


def test_the_summary_passes_only_when_every_test_passed_and_the_decode_is_fast_enough(tmp_path: Path) -> None:
    code, summary = _summary(tmp_path, "", 3.4)
    assert code == 0 and summary["ok"] is True
    assert summary["tests"] == {
        "passed": 1,
        "skipped": 1,
        "failed": [],
        "outcomes": {"tests.test_gpu::test_a": "passed", "tests.test_gpu::test_b": "skipped"},
    }
    assert summary["decode_speedup_at_largest_batch"] == 3.4
    code, summary = _summary(tmp_path, "", 2.9)
    assert code == 1 and summary["ok"] is False
    failed = '<testcase classname="tests.test_gpu" name="test_c"><failure message="x"/></testcase>'
    code, summary = _summary(tmp_path, failed, 3.4)
    assert code == 1 and summary["tests"]["failed"] == ["tests.test_gpu::test_c"]  # type: ignore[index]
