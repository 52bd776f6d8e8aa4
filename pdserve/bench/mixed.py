"""The mixed workload: short streams decoding while long prompts arrive, and what it reports.

For ``duration_s`` seconds, ``streams`` closed loops each send one short request (``MixedPrompts.short``)
and the next as soon as it ends, while one more loop sends long prompts (``MixedPrompts.long``) one
after another. No loop starts a request after ``duration_s``; the run ends when the last one ends.

Reported: output tok/s of all requests over the run's wall time; the short streams' TTFT, ITL and
TPOT (what a long prefill does to the streams decoding next to it); the long prompts' TTFT.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from pdserve.bench.cpu_time import ServerUsage
from pdserve.bench.metrics import BenchMetrics, compute_metrics
from pdserve.bench.openai_client import RequestRecord
from pdserve.bench.report import build_result, format_table
from pdserve.bench.workload import BenchRequest, MixedPrompts

Send = Callable[[BenchRequest], Awaitable[RequestRecord]]


@dataclass(frozen=True)
class MixedRun:
    short: list[RequestRecord]
    long: list[RequestRecord]
    duration_s: float


async def run_mixed(
    send: Send, prompts: MixedPrompts, streams: int, duration_s: float, progress: bool = False
) -> MixedRun:
    """Runs the loops against ``send`` (one streamed request) until ``duration_s`` has passed."""
    short: list[RequestRecord] = []
    long: list[RequestRecord] = []
    short_numbers = itertools.count(1)  # short(0) is the warm-up's
    bar = tqdm(desc="requests", unit="req", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()
    end = start + duration_s

    async def short_loop() -> None:
        while time.perf_counter() < end:
            short.append(await send(prompts.short(next(short_numbers))))
            bar.update(1)

    async def long_loop() -> None:
        for index in itertools.count():
            if time.perf_counter() >= end:
                return
            long.append(await send(prompts.long(index)))
            bar.update(1)

    try:
        await asyncio.gather(long_loop(), *(short_loop() for _ in range(streams)))
    finally:
        bar.close()
    return MixedRun(short, long, time.perf_counter() - start)


def mixed_metrics(run: MixedRun) -> tuple[BenchMetrics, BenchMetrics]:
    """The short streams' metrics and the long prompts', both over the run's whole wall time."""
    return compute_metrics(run.short, run.duration_s), compute_metrics(run.long, run.duration_s)


def mixed_result(run: MixedRun, settings: dict[str, Any], server: ServerUsage | None) -> dict[str, Any]:
    """The JSON-ready result: the short streams' latencies at the top level (as a reference run's),
    throughput over every request, and the long prompts' under ``long``; plus ``table``."""
    short, long = mixed_metrics(run)
    records = [*run.short, *run.long]
    everything = compute_metrics(records, run.duration_s)
    result = build_result(short, records, settings, server)
    result["completed"] = everything.num_completed
    result["failed"] = everything.num_failed
    result["total_input_tokens"] = everything.total_input_tokens
    result["total_output_tokens"] = everything.total_output_tokens
    result["request_throughput"] = everything.request_throughput
    result["output_throughput"] = everything.output_throughput
    result["total_token_throughput"] = everything.total_token_throughput
    if server is not None and server.cpu_s:
        result["output_tokens_per_cpu_s"] = everything.total_output_tokens / server.cpu_s
    result["short"] = {
        "completed": short.num_completed,
        "failed": short.num_failed,
        "output_throughput": short.output_throughput,
    }
    result["long"] = {
        "completed": long.num_completed,
        "failed": long.num_failed,
        "output_throughput": long.output_throughput,
        "ttft_ms": long.ttft.as_dict(),
        "e2el_ms": long.e2el.as_dict(),
    }
    lines = [
        format_table(everything, server, title="all requests"),
        format_table(short, title="short streams"),
        format_table(long, title="long prompts"),
    ]
    result["table"] = "\n".join(lines)
    return result
