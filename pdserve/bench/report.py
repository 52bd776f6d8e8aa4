"""A run's result as a JSON-ready dict and as a table for people."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.bench.cpu_time import ServerUsage
from pdserve.bench.metrics import MS_PER_S, BenchMetrics, Distribution, tpot_s
from pdserve.bench.openai_client import RequestRecord

MAX_ERRORS = 5
WIDTH = 52


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)


def build_result(
    metrics: BenchMetrics,
    records: Sequence[RequestRecord],
    settings: Mapping[str, Any],
    server: ServerUsage | None = None,
) -> dict[str, Any]:
    """Everything about a run as plain JSON types (``inf`` written as the string ``"inf"``)."""
    errors = Counter(r.error for r in records if not r.success)
    server_cpu_s = server.cpu_s if server is not None else None
    result: dict[str, Any] = {
        "settings": {key: _finite(v) if isinstance(v, float) else v for key, v in settings.items()},
        "duration_s": metrics.duration_s,
        "completed": metrics.num_completed,
        "failed": metrics.num_failed,
        "total_input_tokens": metrics.total_input_tokens,
        "total_output_tokens": metrics.total_output_tokens,
        "total_cached_tokens": metrics.total_cached_tokens,
        "prefix_hit_rate": metrics.prefix_hit_rate,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "ttft_ms": metrics.ttft.as_dict(),
        "tpot_ms": metrics.tpot.as_dict(),
        "itl_ms": metrics.itl.as_dict(),
        "e2el_ms": metrics.e2el.as_dict(),
        "slo_ms": metrics.slo_ms,
        "good_requests": metrics.num_good,
        "goodput": metrics.goodput,
        "server_cpu_s": server_cpu_s,
        "output_tokens_per_cpu_s": (metrics.total_output_tokens / server_cpu_s if server_cpu_s else None),
        "server_run_queue_wait_s": server.run_queue_wait_s if server is not None else None,
        "server_processes": server.as_rows() if server is not None else [],
        "errors": [{"error": e, "count": n} for e, n in errors.most_common(MAX_ERRORS)],
        "requests": [_request_row(r) for r in records],
    }
    return result


def _request_row(record: RequestRecord) -> dict[str, Any]:
    tpot = tpot_s(record) if record.success else None
    return {
        "success": record.success,
        "prompt_len": record.prompt_len,
        "max_tokens": record.max_tokens,
        "output_tokens": record.output_tokens if record.success else 0,
        "cached_tokens": record.cached_tokens,
        "ttft_ms": record.ttft_s * MS_PER_S if record.success else None,
        "latency_ms": record.latency_s * MS_PER_S if record.success else None,
        "tpot_ms": tpot * MS_PER_S if tpot is not None else None,
        "error": record.error,
    }


def _line(label: str, value: object) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label + ':':<40}{text:>12}"


def _section(title: str, name: str, dist: Distribution) -> list[str]:
    lines = [f" {title} ".center(WIDTH, "-"), _line(f"Mean {name} (ms)", dist.mean_ms)]
    lines += [_line(f"{key.upper()} {name} (ms)", value) for key, value in dist.percentiles_ms.items()]
    return lines


def format_table(metrics: BenchMetrics, server: ServerUsage | None = None, title: str = "") -> str:
    """The result as a vLLM-style text table."""
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]
    if title:
        lines.append(title)
    lines += [
        _line("Successful requests", metrics.num_completed),
        _line("Failed requests", metrics.num_failed),
        _line("Benchmark duration (s)", metrics.duration_s),
        _line("Total input tokens", metrics.total_input_tokens),
        _line("Total generated tokens", metrics.total_output_tokens),
    ]
    if metrics.prefix_hit_rate is not None:
        lines += [
            _line("Cached prompt tokens", metrics.total_cached_tokens),
            _line("Prefix cache hit rate", metrics.prefix_hit_rate),
        ]
    lines += [
        _line("Request throughput (req/s)", metrics.request_throughput),
        _line("Output token throughput (tok/s)", metrics.output_throughput),
        _line("Total token throughput (tok/s)", metrics.total_token_throughput),
    ]
    if metrics.goodput is not None:
        slo = ", ".join(f"{k}={v:g}" for k, v in metrics.slo_ms.items())
        lines += [
            _line(f"Goodput (req/s) [{slo}]", metrics.goodput),
            _line("Good requests", metrics.num_good),
        ]
    if server is not None and server.cpu_s:
        lines += [
            _line("Server CPU time (s)", server.cpu_s),
            _line("Output tokens per server CPU-second", metrics.total_output_tokens / server.cpu_s),
        ]
        if server.run_queue_wait_s is not None:
            lines.append(_line("Server run-queue wait (s)", server.run_queue_wait_s))
    lines += _section("Time to First Token", "TTFT", metrics.ttft)
    lines += _section("Time per Output Token (excl. 1st token)", "TPOT", metrics.tpot)
    lines += _section("Inter-token Latency", "ITL", metrics.itl)
    lines += _section("End-to-end Latency", "E2EL", metrics.e2el)
    lines.append("=" * WIDTH)
    return "\n".join(lines)
