"""Sends a run's requests: warm-up first, one at a time, then the measured ones on schedule.

Each measured request waits for its arrival offset, then for a concurrency slot, then streams.
The measured wall time runs from the first send to the last request's end.
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import aiohttp
from tqdm import tqdm

from pdserve.bench.openai_client import RequestRecord, build_payload, endpoint_path, stream_request
from pdserve.bench.workload import BenchRequest

TokenCounter = Callable[[str], int]
KEEPALIVE_S = 2.0


@dataclass(frozen=True)
class Target:
    """Where requests go and how they are shaped."""

    base_url: str
    model: str
    endpoint: str
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 600.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + endpoint_path(self.endpoint)


@dataclass(frozen=True)
class RunResult:
    records: list[RequestRecord]
    duration_s: float


def finish_record(record: RequestRecord, count_tokens: TokenCounter | None) -> RequestRecord:
    """Sets the output token count: the server's usage, else the tokenizer's count, else chunks."""
    if record.usage_output_tokens is not None:
        record.output_tokens = record.usage_output_tokens
    elif count_tokens is not None:
        record.output_tokens = count_tokens(record.generated_text)
    else:
        record.output_tokens = record.num_chunks
    return record


async def send_request(
    session: aiohttp.ClientSession, target: Target, request: BenchRequest, count_tokens: TokenCounter | None
) -> RequestRecord:
    payload = build_payload(
        target.endpoint,
        target.model,
        request.prompt,
        request.max_tokens,
        target.temperature,
        target.ignore_eos,
    )
    record = RequestRecord(prompt_len=request.prompt_len, max_tokens=request.max_tokens)
    await stream_request(session, target.url, payload, record, target.timeout_s)
    return finish_record(record, count_tokens)


async def warm_up(
    session: aiohttp.ClientSession,
    target: Target,
    request: BenchRequest,
    num_warmup: int,
    count_tokens: TokenCounter | None = None,
) -> None:
    """Sends ``request`` ``num_warmup`` times in a row; raises RuntimeError when one fails."""
    for _ in range(num_warmup):
        record = await send_request(session, target, request, count_tokens)
        if not record.success:
            raise RuntimeError(f"warm-up request to {target.url} failed: {record.error}")


async def run_requests(
    session: aiohttp.ClientSession,
    target: Target,
    requests: Sequence[BenchRequest],
    offsets_s: Sequence[float],
    concurrency: int = 0,
    count_tokens: TokenCounter | None = None,
    progress: bool = False,
    progress_file: TextIO | None = None,
) -> RunResult:
    """Sends every request at its offset under at most ``concurrency`` in flight (0 = no cap)."""
    if len(offsets_s) != len(requests):
        raise ValueError("one arrival offset per request is needed")
    slots = asyncio.Semaphore(concurrency) if concurrency > 0 else None
    bar = tqdm(
        total=len(requests),
        desc="requests",
        unit="req",
        file=progress_file or sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
    )
    start = time.perf_counter()

    async def one(request: BenchRequest, offset_s: float) -> RequestRecord:
        delay = start + offset_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is None:
            record = await send_request(session, target, request, count_tokens)
        else:
            async with slots:
                record = await send_request(session, target, request, count_tokens)
        bar.update(1)
        return record

    try:
        records = await asyncio.gather(
            *(one(request, offset) for request, offset in zip(requests, offsets_s, strict=True))
        )
    finally:
        bar.close()
    return RunResult(list(records), time.perf_counter() - start)


def new_session(concurrency: int, api_key: str = "", tls_ca: str = "") -> aiohttp.ClientSession:
    """An HTTP session whose connection pool fits the concurrency (0 = unbounded), sending the
    ``api_key`` as a bearer token and trusting ``tls_ca`` for https:// ('' = the system's CAs).

    Idle connections are dropped before common servers' keep-alive timeout (uvicorn: 5 s), so
    that a request never goes out on a connection the server is closing.
    """
    ssl_context = ssl.create_default_context(cafile=tls_ca) if tls_ca else True
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=KEEPALIVE_S, ssl=ssl_context),
        timeout=aiohttp.ClientTimeout(total=None),
        headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
    )
