"""Quality gate: lm-evaluation-harness through pdserve's HTTP front must score what its ``hf`` backend scores.

Usage: python scripts/lm_eval_gate.py [--limit N] [--tasks mc,gen,chat] [--json PATH] [--url URL]

1. resolves the model (SmolLM2-135M-Instruct by default: the preset converted once into the cache);
2. starts ``pdserve up`` on 127.0.0.1 (disaggregated: a prefill, a decode and the gateway, free
   ports; or uses the running server at --url);
3. runs the local tasks in eval/tasks with lm-evaluation-harness, offline, on three models:
   ``local-completions`` and ``local-chat-completions`` against the gateway, and ``hf`` in this
   process on the same model directory, float32 on CPU, one request at a time;
4. compares them sample by sample: every generated string equal; every loglikelihood within
   --ll-tolerance and its is-greedy flag equal; every metric of every sample and of the task equal;
5. checks that the stack it started holds nothing afterwards (no parked or lent KV on the prefill,
   nothing running, waiting or in the KV pool on the decode);
6. prints a table and exits 0 when everything is equal and nothing is held, 1 otherwise.

The comparisons (``--tasks``):
  mc    pdserve_facts_mc (multiple_choice: loglikelihoods through /v1/completions with echo+logprobs)
  gen   pdserve_short_answers (generate_until through /v1/completions, prompts as token ids)
  chat  pdserve_short_answers with the chat template (generate_until through /v1/chat/completions)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
TASKS_DIR = REPO_ROOT / "eval" / "tasks"
sys.path.insert(0, str(REPO_ROOT))

MC_TASK = "pdserve_facts_mc"
GEN_TASK = "pdserve_short_answers"


@dataclass(frozen=True)
class Comparison:
    """One task run on the hf backend and on pdserve through one of lm_eval's API models."""

    name: str
    task: str
    api_model: str
    endpoint: str
    chat: bool


COMPARISONS = {
    "mc": Comparison("mc", MC_TASK, "local-completions", "/v1/completions", chat=False),
    "gen": Comparison("gen", GEN_TASK, "local-completions", "/v1/completions", chat=False),
    "chat": Comparison("chat", GEN_TASK, "local-chat-completions", "/v1/chat/completions", chat=True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model preset or directory")
    parser.add_argument("--cache-dir", default="", help="model cache directory ('' = pdserve's default)")
    parser.add_argument("--limit", type=int, default=0, help="first N documents of each task (0: all)")
    parser.add_argument(
        "--tasks",
        default="mc,gen,chat",
        help=f"comparisons to run, comma-separated ({','.join(COMPARISONS)})",
    )
    parser.add_argument(
        "--ll-tolerance",
        type=float,
        default=1e-4,
        help="largest allowed |pdserve - hf| of one loglikelihood (float32 kernels differ in the last bits)",
    )
    parser.add_argument("--num-concurrent", type=int, default=1, help="lm_eval's concurrent API requests")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the in-process hf model")
    parser.add_argument(
        "--url", default="", help="use the pdserve HTTP front at this URL instead of starting one"
    )
    parser.add_argument("--startup-timeout-s", type=float, default=600.0, help="wait for pdserve up")
    parser.add_argument(
        "--compile",
        choices=("auto", "true", "false"),
        default="auto",
        help="pdserve's --compile (auto: its default; false: eager forwards, a quick start)",
    )
    parser.add_argument("--json", default="", help="write the report (every sample of both backends) here")
    parser.add_argument("--log", default="", help="file for pdserve up's log (default: stderr)")
    args = parser.parse_args(argv)
    names = [name for name in args.tasks.split(",") if name]
    unknown = [name for name in names if name not in COMPARISONS]
    if unknown or not names:
        parser.error(f"--tasks: unknown {unknown}; choose from {','.join(COMPARISONS)}")
    if args.limit < 0:
        parser.error("--limit must be >= 0")
    if not (args.ll_tolerance >= 0 and math.isfinite(args.ll_tolerance)):
        parser.error("--ll-tolerance must be a finite number >= 0")
    if args.num_concurrent < 1:
        parser.error("--num-concurrent must be >= 1")
    if args.threads < 1:
        parser.error("--threads must be >= 1")
    args.comparisons = [COMPARISONS[name] for name in names]
    return args


def offline_environment() -> None:
    """No hub: the datasets are the json files in eval/data, the model and tokenizer a local directory."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@contextlib.contextmanager
def pdserve_up(model_dir: Path, args: argparse.Namespace) -> Iterator[Callable[[], dict[str, Any]]]:
    """Starts a disaggregated stack on 127.0.0.1 with free ports; yields a call that waits until it
    serves and returns its ready line (the stack starts while the hf runs go on)."""
    command = [
        sys.executable, "-m", "pdserve", "up", "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", "0", "--http-port", "0", "--device", "cpu", "--mode", "disaggregated",
        "--startup-timeout-s", str(args.startup_timeout_s), "--compile", args.compile,
    ]  # fmt: skip
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(Path(args.log).open("w")) if args.log else sys.stderr
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
        up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO_ROOT, env=env)
        ready: list[dict[str, Any]] = []

        def wait_ready() -> dict[str, Any]:
            if not ready:
                assert up.stdout is not None
                line = up.stdout.readline()
                if not line:
                    raise SystemExit(f"pdserve up exited with {up.wait()} before it was ready")
                ready.append(json.loads(line))
            return ready[0]

        try:
            yield wait_ready
        finally:
            up.terminate()
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()


def scrape(address: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


HELD = {
    "prefill": ("pdserve_kv_parked_handles", "pdserve_kv_parked_bytes", "pdserve_kv_lent_handles"),
    "decode": ("pdserve_decode_running", "pdserve_decode_waiting", "pdserve_decode_kv_blocks_used"),
}


def held(ready: dict[str, Any], timeout_s: float = 15.0) -> dict[str, dict[str, float]]:
    """What each prefill and decode still holds once the runs are over (empty: nothing), waiting up
    to timeout_s for releases that run in the background."""
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[str, dict[str, float]] = {}
        for role, names in HELD.items():
            for index, service in enumerate(ready[role]):
                m = scrape(service["metrics"])
                values = {name: m.get(name, 0.0) for name in names if m.get(name, 0.0)}
                if values:
                    found[f"{role}-{index}"] = values
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as response:
        return str(json.load(response)["data"][0]["id"])


def evaluate(model: Any, task: str, chat: bool, limit: int, task_manager: Any, model_args: Any = None) -> Any:
    import lm_eval

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        limit=limit or None,
        batch_size=1,
        log_samples=True,
        apply_chat_template=chat,
        fewshot_as_multiturn=chat,
        bootstrap_iters=0,
        task_manager=task_manager,
    )


def sample_record(sample: dict[str, Any], metrics: list[str]) -> dict[str, Any]:
    """What the gate compares of one document: the raw responses and each metric's value."""
    responses: list[Any] = []
    for response in sample["resps"]:
        value = response[0]
        responses.append(list(value) if isinstance(value, tuple | list) else value)
    return {
        "doc_id": sample["doc_id"],
        "responses": responses,
        "metrics": {name: sample[name] for name in metrics if name in sample},
    }


def task_metrics(results: dict[str, Any], task: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in results["results"][task].items():
        name, _, _ = key.partition(",")
        if isinstance(value, int | float) and not name.endswith("_stderr"):
            out[key] = float(value)
    return out


def collect(results: dict[str, Any], task: str) -> dict[str, Any]:
    metrics = task_metrics(results, task)
    names = sorted({key.partition(",")[0] for key in metrics})
    samples = sorted((sample_record(s, names) for s in results["samples"][task]), key=lambda r: r["doc_id"])
    return {"metrics": metrics, "samples": samples}


def differences(hf: dict[str, Any], pd: dict[str, Any], tolerance: float) -> tuple[list[str], float]:
    """Every way pdserve's run differs from hf's, and the largest loglikelihood difference."""
    out: list[str] = []
    worst = 0.0
    if hf["metrics"] != pd["metrics"]:
        out.append(f"task metrics: hf {hf['metrics']} != pdserve {pd['metrics']}")
    if [s["doc_id"] for s in hf["samples"]] != [s["doc_id"] for s in pd["samples"]]:
        return [*out, "the two runs scored different documents"], worst
    for h, p in zip(hf["samples"], pd["samples"], strict=True):
        doc = h["doc_id"]
        if h["metrics"] != p["metrics"]:
            out.append(f"doc {doc}: metrics hf {h['metrics']} != pdserve {p['metrics']}")
        if len(h["responses"]) != len(p["responses"]):
            out.append(
                f"doc {doc}: {len(h['responses'])} responses from hf, {len(p['responses'])} from pdserve"
            )
            continue
        for index, (hr, pr) in enumerate(zip(h["responses"], p["responses"], strict=True)):
            if isinstance(hr, str) or isinstance(pr, str):
                if hr != pr:
                    out.append(f"doc {doc}: generated hf {hr!r} != pdserve {pr!r}")
                continue
            (h_ll, h_greedy), (p_ll, p_greedy) = hr, pr
            delta = abs(float(h_ll) - float(p_ll))
            worst = max(worst, delta) if math.isfinite(delta) else math.inf
            if not delta <= tolerance:
                out.append(
                    f"doc {doc} choice {index}: loglikelihood hf {h_ll!r} pdserve {p_ll!r} (|d|={delta:.2e})"
                )
            if bool(h_greedy) != bool(p_greedy):
                out.append(f"doc {doc} choice {index}: is_greedy hf {h_greedy} != pdserve {p_greedy}")
    return out, worst


def table(rows: list[dict[str, Any]]) -> str:
    header = (
        "comparison",
        "task",
        "pdserve model",
        "metric",
        "hf",
        "pdserve",
        "samples",
        "max |d ll|",
        "equal",
    )
    lines = [header]
    for row in rows:
        for metric, hf_value in row["hf"]["metrics"].items():
            if metric.startswith("sample_len"):
                continue  # the "samples" column
            pd_value = row["pdserve"]["metrics"].get(metric, math.nan)
            lines.append(
                (
                    row["name"],
                    row["task"],
                    row["api_model"],
                    metric,
                    f"{hf_value:.4f}",
                    f"{pd_value:.4f}",
                    str(len(row["hf"]["samples"])),
                    f"{row['max_ll_delta']:.1e}" if row["loglikelihood"] else "-",
                    "yes" if not row["differences"] else "NO",
                )
            )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        " | ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)) for line in lines
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    offline_environment()
    os.chdir(REPO_ROOT)  # the task files name their data relative to the repository root
    from pdserve.model.source import resolve_model_dir

    model_dir = resolve_model_dir(args.model, args.cache_dir or None)
    with contextlib.ExitStack() as stack:
        # The stack starts first: its processes load while this one imports lm_eval and runs hf.
        wait_ready = None if args.url else stack.enter_context(pdserve_up(model_dir, args))
        import torch
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager

        for name in ("lm_eval", "lm-eval"):
            logging.getLogger(name).setLevel(logging.WARNING)
        torch.set_num_threads(args.threads)
        task_manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
        started = time.monotonic()
        hf = HFLM(pretrained=str(model_dir), dtype="float32", device="cpu", batch_size=1)
        hf_runs = {
            c.name: collect(evaluate(hf, c.task, c.chat, args.limit, task_manager), c.task)
            for c in args.comparisons
        }
        hf_s = time.monotonic() - started
        ready = wait_ready() if wait_ready is not None else None
        url = f"http://{ready['gateway']['http']}" if ready is not None else args.url.rstrip("/")
        name = served_model(url)
        started = time.monotonic()
        rows = []
        for c in args.comparisons:
            model_args: dict[str, Any] = {
                "model": name,
                "base_url": f"{url}{c.endpoint}",
                "num_concurrent": args.num_concurrent,
                "max_retries": 1,
                "timeout": 600,
            }
            if c.chat:
                # Without a tokenizer the chat model does not know the EOS string that hf adds to
                # the stop strings (the server stops at the EOS token either way).
                model_args["eos_string"] = hf.tokenizer.eos_token
            else:
                model_args |= {"tokenizer_backend": "huggingface", "tokenizer": str(model_dir)}
            pd = collect(evaluate(c.api_model, c.task, c.chat, args.limit, task_manager, model_args), c.task)
            diffs, worst = differences(hf_runs[c.name], pd, args.ll_tolerance)
            rows.append(
                {
                    "name": c.name,
                    "task": c.task,
                    "api_model": c.api_model,
                    "chat": c.chat,
                    "loglikelihood": c.task == MC_TASK,
                    "hf": hf_runs[c.name],
                    "pdserve": pd,
                    "max_ll_delta": worst,
                    "differences": diffs,
                }
            )
        pdserve_s = time.monotonic() - started
        leaks = held(ready) if ready is not None else {}
    return {
        "model": str(model_dir),
        "served_model": name,
        "limit": args.limit,
        "ll_tolerance": args.ll_tolerance,
        "hf_s": round(hf_s, 1),
        "pdserve_s": round(pdserve_s, 1),
        "comparisons": rows,
        "leaks": leaks,
        "equal": all(not row["differences"] for row in rows) and not leaks,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(table(report["comparisons"]))
    for row in report["comparisons"]:
        for line in row["differences"][:20]:
            print(f"{row['name']}: {line}")
    for service, values in report["leaks"].items():
        print(f"after the runs {service} still holds {values}")
    print(
        f"hf {report['hf_s']} s, pdserve {report['pdserve_s']} s: "
        + ("pdserve scores what hf scores" if report["equal"] else "pdserve DIFFERS from hf")
    )
    return 0 if report["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
