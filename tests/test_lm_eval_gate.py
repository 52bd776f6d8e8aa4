"""scripts/lm_eval_gate.py, short: lm-evaluation-harness's ``local-completions`` and
``local-chat-completions`` against ``pdserve up`` (disaggregated, SmolLM2-135M-Instruct) score every
sample of the local tasks in eval/ exactly as its ``hf`` backend does on the same model.

The gate runs once for the module (a few documents of each task); the assertions here read the raw
per-sample results of both backends from its report rather than trusting its verdict alone. The
model is the preset converted once into pdserve's default cache (the one ``make run`` uses).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest

from tests.stack import REPO_ROOT

pytestmark = pytest.mark.timeout(900)

GATE = REPO_ROOT / "scripts" / "lm_eval_gate.py"
LIMIT = 3
LL_TOLERANCE = 1e-4


def load_gate() -> ModuleType:
    """scripts/lm_eval_gate.py as a module (scripts/ is no package)."""
    if "lm_eval_gate" in sys.modules:
        return sys.modules["lm_eval_gate"]
    spec = importlib.util.spec_from_file_location("lm_eval_gate", GATE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("lm-eval-gate")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    command = [
        sys.executable, str(GATE), "--limit", str(LIMIT), "--ll-tolerance", str(LL_TOLERANCE),
        "--json", str(out / "report.json"), "--log", str(out / "up.log"),
        "--compile", "false",  # the gate compares numbers; a cold compile would cost minutes here
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=840)
    log = (out / "up.log").read_text() if (out / "up.log").exists() else ""
    assert (out / "report.json").exists(), f"{done.stdout}\n{done.stderr[-6000:]}\n{log[-4000:]}"
    result: dict[str, Any] = json.loads((out / "report.json").read_text())
    result["returncode"] = done.returncode
    result["stdout"] = done.stdout
    return result


def comparison(report: dict[str, Any], name: str) -> dict[str, Any]:
    rows = [row for row in report["comparisons"] if row["name"] == name]
    assert len(rows) == 1, [row["name"] for row in report["comparisons"]]
    return rows[0]


def test_the_gate_passes(report: dict[str, Any]) -> None:
    assert report["returncode"] == 0, report["stdout"]
    assert report["equal"] is True
    assert report["leaks"] == {}  # no parked KV, nothing running or in the decode's pool afterwards
    assert "pdserve scores what hf scores" in report["stdout"]
    assert [row["name"] for row in report["comparisons"]] == ["mc", "gen", "chat"]


def test_loglikelihoods_equal_hf_per_choice(report: dict[str, Any]) -> None:
    row = comparison(report, "mc")
    hf, pd = row["hf"], row["pdserve"]
    assert len(hf["samples"]) == len(pd["samples"]) == LIMIT
    assert pd["metrics"] == hf["metrics"]
    assert set(hf["metrics"]) >= {"acc,none", "acc_norm,none"}
    for h, p in zip(hf["samples"], pd["samples"], strict=True):
        assert h["doc_id"] == p["doc_id"]
        assert p["metrics"] == h["metrics"]
        assert len(h["responses"]) == len(p["responses"]) == 4  # four choices, one loglikelihood each
        for (h_ll, h_greedy), (p_ll, p_greedy) in zip(h["responses"], p["responses"], strict=True):
            assert math.isfinite(h_ll) and h_ll < 0
            assert abs(p_ll - h_ll) <= LL_TOLERANCE, (h["doc_id"], h_ll, p_ll)
            assert p_greedy == h_greedy
        # The choices really differ in likelihood: a server that returned one constant would fail here.
        assert len({round(ll, 3) for ll, _ in h["responses"]}) > 1


@pytest.mark.parametrize("name", ["gen", "chat"])
def test_generations_equal_hf_string_for_string(report: dict[str, Any], name: str) -> None:
    row = comparison(report, name)
    hf, pd = row["hf"], row["pdserve"]
    assert len(hf["samples"]) == len(pd["samples"]) == LIMIT
    assert pd["metrics"] == hf["metrics"]
    hf_texts = [s["responses"] for s in hf["samples"]]
    pd_texts = [s["responses"] for s in pd["samples"]]
    assert pd_texts == hf_texts
    assert all(isinstance(text, str) for texts in hf_texts for text in texts)
    assert any(text.strip() for texts in hf_texts for text in texts)
    for h, p in zip(hf["samples"], pd["samples"], strict=True):
        assert p["metrics"] == h["metrics"]


def test_the_gate_reports_every_kind_of_difference(report: dict[str, Any]) -> None:
    gate = load_gate()
    mc, gen = comparison(report, "mc"), comparison(report, "gen")
    assert gate.differences(mc["hf"], mc["pdserve"], LL_TOLERANCE)[0] == []
    assert gate.differences(gen["hf"], gen["pdserve"], LL_TOLERANCE)[0] == []

    shifted = copy.deepcopy(mc["pdserve"])
    shifted["samples"][0]["responses"][1][0] += 10 * LL_TOLERANCE
    diffs, worst = gate.differences(mc["hf"], shifted, LL_TOLERANCE)
    assert len(diffs) == 1 and "loglikelihood" in diffs[0]
    assert worst > LL_TOLERANCE

    not_greedy = copy.deepcopy(mc["pdserve"])
    not_greedy["samples"][1]["responses"][0][1] = not not_greedy["samples"][1]["responses"][0][1]
    assert any("is_greedy" in d for d in gate.differences(mc["hf"], not_greedy, LL_TOLERANCE)[0])

    edited = copy.deepcopy(gen["pdserve"])
    edited["samples"][2]["responses"][0] += " "
    assert any("generated" in d for d in gate.differences(gen["hf"], edited, LL_TOLERANCE)[0])

    scored = copy.deepcopy(gen["pdserve"])
    metric = next(iter(scored["metrics"]))
    scored["metrics"][metric] += 1.0
    assert any("task metrics" in d for d in gate.differences(gen["hf"], scored, LL_TOLERANCE)[0])

    fewer = copy.deepcopy(gen["pdserve"])
    fewer["samples"].pop()
    assert any("different documents" in d for d in gate.differences(gen["hf"], fewer, LL_TOLERANCE)[0])


def test_bad_arguments_are_refused() -> None:
    gate = load_gate()
    for argv in (
        ["--tasks", "nope"],
        ["--limit", "-1"],
        ["--ll-tolerance", "nan"],
        ["--num-concurrent", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            gate.parse_args(argv)
        assert exc.value.code == 2, argv
