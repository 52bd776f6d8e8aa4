"""One comparison table from several ``pdserve bench --json`` results.

    python -m pdserve.bench.compare [--baseline NAME] NAME=RESULT.json ...

Each row is one system; the ratio column divides its output tok/s by the baseline's (the first
row unless ``--baseline`` names another). Rows named ``WORKLOAD/SYSTEM`` are compared within
their workload: the baseline of ``mixed/pdserve`` is ``mixed/BASELINE`` (or the workload's first
row). The mixed workload's rows also show the long prompts' TTFT p50; a server that reports cached
prompt tokens shows its prefix cache hit rate. With ``--server-pid``, tok/CPU-s is output tokens per
second of server CPU, and wait/CPU-s the seconds its threads waited for a core per second they ran.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = (
    ("system", "<"),
    ("ok/failed", ">"),
    ("out tok/s", ">"),
    ("x baseline", ">"),
    ("TTFT mean", ">"),
    ("TTFT p50", ">"),
    ("TTFT p99", ">"),
    ("TPOT mean", ">"),
    ("ITL p50", ">"),
    ("ITL p99", ">"),
    ("long TTFT p50", ">"),
    ("prefix hits", ">"),
    ("tok/CPU-s", ">"),
    ("wait/CPU-s", ">"),
)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _wait_per_cpu_s(result: dict[str, Any]) -> float | None:
    """Seconds the server's threads waited for a CPU per second they ran (``cpu_time``)."""
    wait, cpu = result.get("server_run_queue_wait_s"), result.get("server_cpu_s")
    return wait / cpu if wait is not None and cpu else None


def table(results: Sequence[tuple[str, dict[str, Any]]], baseline: str = "") -> str:
    """A Markdown table of ``(name, result)`` pairs (times in ms)."""
    if not results:
        raise ValueError("no results to compare")
    names = [name for name, _ in results]
    systems = {name.rpartition("/")[2] for name in names}
    if baseline and baseline not in systems:
        raise ValueError(f"baseline {baseline!r} is not one of {', '.join(sorted(systems))}")
    by_name = dict(results)
    rows = []
    for name, result in results:
        workload = name.rpartition("/")[0]
        group = [n for n in names if n.rpartition("/")[0] == workload]
        base_name = f"{workload}/{baseline}" if workload and baseline else baseline
        base = by_name[base_name if base_name in by_name else group[0]]["output_throughput"]
        long = result.get("long")
        rows.append(
            [
                name,
                f"{result['completed']}/{result['failed']}",
                _fmt(result["output_throughput"]),
                _fmt(result["output_throughput"] / base if base else None, 2),
                _fmt(result["ttft_ms"]["mean"]),
                _fmt(result["ttft_ms"]["p50"]),
                _fmt(result["ttft_ms"]["p99"]),
                _fmt(result["tpot_ms"]["mean"]),
                _fmt(result["itl_ms"]["p50"]),
                _fmt(result["itl_ms"].get("p99")),
                _fmt(long["ttft_ms"]["p50"] if isinstance(long, dict) else None),
                _fmt(result.get("prefix_hit_rate"), 3),
                _fmt(result.get("output_tokens_per_cpu_s")),
                _fmt(_wait_per_cpu_s(result), 2),
            ]
        )
    widths = [max(len(title), *(len(row[i]) for row in rows)) for i, (title, _) in enumerate(COLUMNS)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            f"{cell:{align}{width}}" for cell, (_, align), width in zip(cells, COLUMNS, widths, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    separator = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if a == ">" else "-" * (w + 2)
            for (_, a), w in zip(COLUMNS, widths, strict=True)
        )
        + "|"
    )
    return "\n".join([line([title for title, _ in COLUMNS]), separator, *(line(row) for row in rows)])


def _named_result(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=RESULT.json, got {text!r}")
    try:
        return name, json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {error}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.compare", description=__doc__)
    parser.add_argument(
        "--baseline", default="", help="system whose output tok/s is 1.0x (default: the first)"
    )
    parser.add_argument("results", nargs="+", type=_named_result, metavar="NAME=RESULT.json")
    args = parser.parse_args(argv)
    try:
        print(table(args.results, args.baseline))
    except (KeyError, ValueError) as error:
        print(f"compare: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
