"""scripts/soak.py end to end with tiny settings: `pdserve up` with 2 prefills and 2 decodes, a few
streams, one decode and one prefill killed once. Every request exact, nothing left held."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import REPO_ROOT, service_env

pytestmark = pytest.mark.timeout(900)


def test_the_soak_runs_kills_and_checks(cache_dir: Path, tmp_path: Path) -> None:
    summary_path = tmp_path / "soak.json"
    settings = {
        "--cache-dir": str(cache_dir),
        "--streams": "6",
        "--duration-s": "24",
        "--kill-every-s": "12",
        "--max-tokens": "40",
        "--num-prompts": "4",
        "--warm-up-s": "4",
        "--sample-every-s": "1",
        "--rss-tolerance": "1.0",
        "--json": str(summary_path),
        "--log": str(tmp_path / "up.log"),
    }
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "soak.py"), *(x for kv in settings.items() for x in kv)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=service_env(cache_dir),
        timeout=840,
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary == json.loads(done.stdout)
    assert summary["failed"] == 0, summary["first_failures"]
    assert summary["completed"] > 0 and summary["mismatched"] == 0
    assert [set(k) for k in summary["kills"]] == [{"at_s", "waited_s", "decode", "prefill"}]
    assert summary["kills"][0]["decode"] == "decode-0" and summary["kills"][0]["prefill"] == "prefill-0"
    assert summary["leaks"] == {}
    assert summary["rss_judged"], "no RSS sample after warm-up"
    assert summary["ok"] and done.returncode == 0
