"""The GPU check's own pieces that run anywhere: the script parses, keeps a CPU .venv as it is, every
test it requires exists, and its summary reads pytest's report and the benchmark's lines into one
verdict that fails on any required test skipped or missing."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.stack import REPO_ROOT

SCRIPT = REPO_ROOT / "scripts/gpu_check.sh"
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import gpu_summary  # noqa: E402

REQUIRED = gpu_summary.ONE_GPU + gpu_summary.TWO_GPUS + gpu_summary.DEEPEP


def _case(name: str, outcome: str = "passed", params: str = "") -> str:
    classname, _, test = name.partition("::")
    child = {"passed": "", "skipped": '<skipped message="s"/>', "failed": '<failure message="x"/>'}[outcome]
    return f'<testcase classname="{classname}" name="{test}{params}">{child}</testcase>'


def _summary(
    tmp_path: Path, cases: list[str], speedup: float, *flags: str, capsys: pytest.CaptureFixture[str]
) -> tuple[int, dict[str, Any]]:
    """The summary of a pytest report of ``cases`` and a benchmark reaching ``speedup`` at batch 64."""
    (tmp_path / "junit.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
        + "".join(cases)
        + "</testsuite></testsuites>"
    )
    rows = [{"batch": 1, "speedup": 1.2}, {"batch": 64, "speedup": speedup}]
    (tmp_path / "bench_moe_decode.jsonl").write_text(
        "noise\n" + "\n".join(json.dumps(r) for r in rows) + "\n"
    )
    argv = sys.argv
    sys.argv = ["gpu_summary.py", str(tmp_path), "--seconds", "12", *flags]
    try:
        code = gpu_summary.main()
    finally:
        sys.argv = argv
    return code, json.loads(capsys.readouterr().out)


def test_the_script_parses_and_never_upgrades_the_torch_of_dot_venv() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    text = SCRIPT.read_text()
    assert not re.search(r"\.venv/bin/python -m pip install", text), "a CPU torch in .venv stays as it is"
    assert "python3 -m venv .venv-gpu" in text and "timeout -s INT" in text
    assert ".venv-gpu/" in (REPO_ROOT / ".gitignore").read_text().split()


def test_every_test_the_check_requires_exists() -> None:
    files = sorted({name.partition("::")[0].replace(".", "/") + ".py" for name in REQUIRED})
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            *files,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = {
        line.split("[")[0].replace("/", ".").replace(".py::", "::") for line in done.stdout.splitlines()
    }
    assert set(REQUIRED) <= collected, sorted(set(REQUIRED) - collected)


def test_the_summary_passes_only_when_every_required_test_passed_and_the_decode_is_fast_enough(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(cases: list[str], speedup: float, *flags: str) -> tuple[int, dict[str, Any]]:
        return _summary(tmp_path, cases, speedup, *flags, capsys=capsys)

    one_gpu = [_case(name, params="[a]") for name in gpu_summary.ONE_GPU]
    two_gpus = [_case(name, "skipped") for name in gpu_summary.TWO_GPUS + gpu_summary.DEEPEP]
    code, summary = run(one_gpu + two_gpus, 3.4, "--gpus", "1")
    assert code == 0 and summary["ok"] is True
    tests = summary["tests"]
    assert isinstance(tests, dict)
    assert tests["passed"] == len(one_gpu) and tests["failed"] == [] and tests["unmet"] == []
    assert set(tests["required"]) == set(gpu_summary.ONE_GPU)
    assert summary["decode_speedup_at_largest_batch"] == 3.4
    code, summary = run(one_gpu + two_gpus, 2.9, "--gpus", "1")
    assert code == 1 and summary["ok"] is False
    # Two GPUs: the tests of two GPUs skipped fail the check; DeepEP's only when deep_ep imports.
    code, summary = run(one_gpu + two_gpus, 3.4, "--gpus", "2", "--deepep", "0")
    assert code == 1 and summary["tests"]["unmet"] == sorted(gpu_summary.TWO_GPUS)
    passed = one_gpu + [_case(name) for name in gpu_summary.TWO_GPUS]
    assert run(passed, 3.4, "--gpus", "2", "--deepep", "0")[0] == 0
    code, summary = run(passed, 3.4, "--gpus", "2", "--deepep", "1")
    assert code == 1 and summary["tests"]["required"][gpu_summary.DEEPEP[0]] == "missing"
    # One case of a parametrized test failing, or a required test missing, fails it.
    failed = [*one_gpu, _case(gpu_summary.ONE_GPU[1], "failed", "[b]")]
    code, summary = run(failed, 3.4, "--gpus", "1")
    assert code == 1 and summary["tests"]["required"][gpu_summary.ONE_GPU[1]] == "failed"
    code, summary = run(one_gpu[1:], 3.4, "--gpus", "1")
    assert code == 1 and summary["tests"]["unmet"] == [gpu_summary.ONE_GPU[0]]


def test_the_summary_runs_as_the_check_runs_it(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
        + "".join(_case(name) for name in gpu_summary.ONE_GPU)
        + "</testsuite></testsuites>"
    )
    (tmp_path / "bench_moe_decode.jsonl").write_text(json.dumps({"batch": 64, "speedup": 3.5}) + "\n")
    done = subprocess.run(
        [sys.executable, "scripts/gpu_summary.py", str(tmp_path), "--gpus", "1", "--min-ratio", "3.0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["ok"] is True


def test_the_wheels_for_an_offline_gpu_machine_are_the_project_closure_without_torch() -> None:
    import gpu_wheels

    pins = dict(pin.split("==") for pin in gpu_wheels.pinned())
    for needed in ("grpcio", "grpcio-health-checking", "transformers", "fastapi", "llguidance", "pytest"):
        assert needed in pins, needed
    assert {"torch", "numpy", "sympy", "networkx"}.isdisjoint(pins), "the GPU machine's torch keeps its own"
    assert pins["grpcio"] == importlib.metadata.version("grpcio")
    text = SCRIPT.read_text()
    assert "--no-index --no-deps" in text and ".whl/*.whl" in text


def test_its_venv_sees_the_packages_of_a_python_that_is_itself_a_venv(tmp_path: Path) -> None:
    """GPU images ship their torch in a venv of their own; the check's venv on top of that python
    must see it. This test's python is a venv too."""
    venv = tmp_path / "venv-gpu"
    done = subprocess.run(
        ["bash", "-c", 'source "$1" && venv_over "$2" "$3"', "bash", str(SCRIPT), sys.executable, str(venv)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    seen = subprocess.run(
        [str(venv / "bin/python"), "-c", "import sys, torch, grpc; print(sys.prefix)"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert seen.returncode == 0, seen.stderr[-2000:]
    assert seen.stdout.strip() == str(venv)
