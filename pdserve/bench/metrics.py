"""Benchmark statistics from per-request records, defined as in vLLM's serving benchmark.

- TTFT: request start to the first streamed chunk.
- E2E latency: request start to the last streamed chunk.
- TPOT, per request with more than one output token: (latency - TTFT) / (output tokens - 1).
- ITL: every gap between two consecutive streamed chunks, pooled over all requests.
- Throughput: completed requests and output tokens over the benchmark's wall time.
- Goodput: completed requests per second whose TTFT, TPOT and E2E latency all meet the SLOs
  (a request with one output token has TPOT 0).
- Prefix cache hit rate: prompt tokens the server says it took from its prefix cache
  (``usage.prompt_tokens_details.cached_tokens``) over the prompt tokens of the completed requests;
  None when no request's usage said.
Percentiles interpolate linearly (``numpy.percentile``); an empty series reports 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.openai_client import RequestRecord

PERCENTILES = (50.0, 90.0, 99.0)
MS_PER_S = 1000.0


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of one latency series, in milliseconds."""

    mean_ms: float
    percentiles_ms: dict[str, float]

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean_ms, **self.percentiles_ms}


def distribution(values_s: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> Distribution:
    """Mean and percentiles (keys ``p50``, ``p90``, ...) of ``values_s`` converted to ms."""
    values = np.asarray(values_s, dtype=np.float64) * MS_PER_S
    if values.size == 0:
        return Distribution(0.0, {_key(p): 0.0 for p in percentiles})
    return Distribution(float(values.mean()), {_key(p): float(np.percentile(values, p)) for p in percentiles})


def _key(percentile: float) -> str:
    return f"p{percentile:g}"


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first, or None with fewer than two output tokens."""
    if record.output_tokens < 2:
        return None
    return (record.latency_s - record.ttft_s) / (record.output_tokens - 1)


def meets_slo(record: RequestRecord, slo_ms: Mapping[str, float]) -> bool:
    """Whether a completed request meets every SLO in ``slo_ms`` (keys ttft_ms, tpot_ms, e2el_ms)."""
    observed_ms = {
        "ttft_ms": record.ttft_s * MS_PER_S,
        "tpot_ms": (tpot_s(record) or 0.0) * MS_PER_S,
        "e2el_ms": record.latency_s * MS_PER_S,
    }
    return all(observed_ms[key] <= limit for key, limit in slo_ms.items())


@dataclass(frozen=True)
class BenchMetrics:
    """Everything a run reports, derived from its records and wall time."""

    duration_s: float
    num_completed: int
    num_failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution
    slo_ms: dict[str, float] = field(default_factory=dict)
    num_good: int | None = None
    goodput: float | None = None
    total_cached_tokens: int | None = None

    @property
    def prefix_hit_rate(self) -> float | None:
        if self.total_cached_tokens is None or not self.total_input_tokens:
            return None
        return self.total_cached_tokens / self.total_input_tokens


def compute_metrics(
    records: Sequence[RequestRecord], duration_s: float, slo_ms: Mapping[str, float] | None = None
) -> BenchMetrics:
    """The statistics of one run; ``duration_s`` is the wall time of the measured requests."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    tpots = [t for t in (tpot_s(r) for r in done) if t is not None]
    reported = [r.cached_tokens for r in done if r.cached_tokens is not None]
    num_good: int | None = None
    goodput: float | None = None
    if slo_ms:
        num_good = sum(1 for r in done if meets_slo(r, slo_ms))
        goodput = num_good / duration_s
    return BenchMetrics(
        duration_s=duration_s,
        num_completed=len(done),
        num_failed=len(records) - len(done),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttft=distribution([r.ttft_s for r in done]),
        tpot=distribution(tpots),
        itl=distribution([gap for r in done for gap in r.itl_s]),
        e2el=distribution([r.latency_s for r in done]),
        slo_ms=dict(slo_ms or {}),
        num_good=num_good,
        goodput=goodput,
        total_cached_tokens=sum(reported) if reported else None,
    )
