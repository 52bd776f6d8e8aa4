"""`pdserve bench`: statistics as vLLM defines them, seeded workloads, chunk timing over real
sockets, the JSON result, and one real run against a pdserve stack's HTTP front."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from pdserve.bench.compare import table
from pdserve.bench.config import BenchConfig, parse_slo
from pdserve.bench.launch import http_base_url, up_command
from pdserve.bench.metrics import compute_metrics, distribution, meets_slo, tpot_s
from pdserve.bench.mixed import MixedRun, mixed_result, run_mixed
from pdserve.bench.openai_client import RequestRecord, build_payload
from pdserve.bench.runner import Target, new_session, run_requests, send_request
from pdserve.bench.workload import (
    BenchRequest,
    MixedPrompts,
    arrival_offsets,
    length_range,
    sample_requests,
    shared_prefix_requests,
)
from tests.conftest import assert_no_leaks
from tests.stack import REPO_ROOT, Stack, service_env


def record(
    ttft_s: float, latency_s: float, output_tokens: int, itl_s: list[float] | None = None
) -> RequestRecord:
    return RequestRecord(
        prompt_len=10,
        max_tokens=output_tokens,
        success=True,
        ttft_s=ttft_s,
        latency_s=latency_s,
        output_tokens=output_tokens,
        itl_s=itl_s or [],
    )


# -- statistics --------------------------------------------------------------------------------


def test_percentiles_interpolate_linearly_in_ms() -> None:
    values_s = [i / 1000 for i in range(1, 101)]  # 1 ms .. 100 ms
    dist = distribution(values_s)
    assert dist.mean_ms == pytest.approx(50.5)
    assert dist.percentiles_ms == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01})
    assert distribution([0.25]).percentiles_ms == pytest.approx({"p50": 250.0, "p90": 250.0, "p99": 250.0})
    empty = distribution([])
    assert empty.mean_ms == 0.0 and set(empty.percentiles_ms.values()) == {0.0}


def test_tpot_excludes_the_first_token_and_itl_pools_chunk_gaps() -> None:
    # 11 tokens: TTFT 100 ms, then 10 more tokens by 600 ms -> 50 ms each.
    one = record(0.1, 0.6, 11, itl_s=[0.05] * 10)
    # 5 tokens in 3 chunks (bundled): TPOT counts tokens, ITL counts chunk gaps.
    bundled = record(0.2, 0.6, 5, itl_s=[0.1, 0.3])
    single = record(0.3, 0.3, 1)
    assert tpot_s(one) == pytest.approx(0.05)
    assert tpot_s(bundled) == pytest.approx(0.1)
    assert tpot_s(single) is None
    metrics = compute_metrics([one, bundled, single], duration_s=2.0)
    assert metrics.tpot.mean_ms == pytest.approx(75.0)  # single-token requests have no TPOT
    assert metrics.itl.mean_ms == pytest.approx((10 * 50 + 100 + 300) / 12)
    assert metrics.itl.percentiles_ms["p99"] == pytest.approx(
        float(np.percentile([50] * 10 + [100, 300], 99))
    )
    assert metrics.ttft.mean_ms == pytest.approx(200.0)
    assert metrics.e2el.percentiles_ms["p50"] == pytest.approx(600.0)
    assert metrics.total_output_tokens == 17
    assert metrics.output_throughput == pytest.approx(8.5)
    assert metrics.request_throughput == pytest.approx(1.5)
    assert metrics.total_token_throughput == pytest.approx((30 + 17) / 2.0)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = record(0.1, 0.5, 5)  # TPOT 100 ms
    slow_first = record(0.9, 1.3, 5)  # TTFT 900 ms
    slow_steps = record(0.1, 2.1, 5)  # TPOT 500 ms
    single = record(0.2, 0.2, 1)  # TPOT counts as 0
    failed = RequestRecord(prompt_len=10, max_tokens=5, error="HTTP 500")
    records = [fast, slow_first, slow_steps, single, failed]
    slo = parse_slo(("ttft_ms=500", "tpot_ms=200"))
    assert [meets_slo(r, slo) for r in records[:4]] == [True, False, False, True]
    metrics = compute_metrics(records, duration_s=4.0, slo_ms=slo)
    assert (metrics.num_completed, metrics.num_failed) == (4, 1)
    assert metrics.num_good == 2
    assert metrics.goodput == pytest.approx(0.5)
    assert compute_metrics(records, 4.0, parse_slo(("e2el_ms=600",))).num_good == 2
    assert compute_metrics(records, 4.0).goodput is None


@pytest.mark.parametrize(
    "items", [("ttft=5",), ("ttft_ms",), ("ttft_ms=-1",), ("ttft_ms=abc",), ("tpot_ms=1", "tpot_ms=2")]
)
def test_bad_slo_is_refused(items: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="slo"):
        parse_slo(items)
    with pytest.raises(ValueError, match="slo"):
        BenchConfig(slo=items)


def test_config_refuses_bad_values() -> None:
    for kwargs in (
        {"endpoint": "embeddings"},
        {"endpoint": "chat", "prompt_format": "ids"},
        {"request_rate": 0.0},
        {"random_range_ratio": 1.0},
        {"num_prompts": 0},
        {"mode": "fused"},
        {"base_url": "127.0.0.1:8000"},
        {"server_pid": ("abc",)},
    ):
        with pytest.raises(ValueError):
            BenchConfig(**kwargs)  # type: ignore[arg-type]
    assert BenchConfig().uses_token_ids and not BenchConfig(endpoint="chat").uses_token_ids


# -- workload ----------------------------------------------------------------------------------


def test_poisson_arrivals_are_reproducible_with_a_seed() -> None:
    first = arrival_offsets(2000, 50.0, seed=7)
    assert first == arrival_offsets(2000, 50.0, seed=7)
    assert first != arrival_offsets(2000, 50.0, seed=8)
    gaps = np.diff(first)
    assert first[0] == 0.0 and bool(np.all(gaps >= 0))
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.1)
    assert gaps.std() == pytest.approx(1 / 50.0, rel=0.15)  # exponential: std == mean
    assert arrival_offsets(4, float("inf"), seed=7) == [0.0] * 4


def test_requests_are_seeded_sized_and_avoid_special_tokens() -> None:
    class Vocab:
        all_special_ids = [0, 1]

        def __len__(self) -> int:
            return 50

    fixed = sample_requests(20, 16, 8, 0.0, seed=3, token_ids=True, tokenizer=Vocab())
    assert fixed == sample_requests(20, 16, 8, 0.0, seed=3, token_ids=True, tokenizer=Vocab())
    assert {(len(r.prompt), r.prompt_len, r.max_tokens) for r in fixed} == {(16, 16, 8)}
    ids = {token for r in fixed for token in r.prompt}
    assert ids <= set(range(2, 50)) and len(ids) > 30
    ranged = sample_requests(200, 100, 40, 0.5, seed=3, token_ids=True, vocab_size=1000)
    assert length_range(100, 0.5) == (50, 150)
    assert all(50 <= r.prompt_len <= 150 and 20 <= r.max_tokens <= 60 for r in ranged)
    assert len({r.prompt_len for r in ranged}) > 20
    words = sample_requests(3, 12, 4, 0.0, seed=3, token_ids=False)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 12 for r in words)
    with pytest.raises(ValueError, match="vocab"):
        sample_requests(1, 4, 4, 0.0, seed=0, token_ids=True)


def test_payloads_carry_vllm_fields() -> None:
    completion = build_payload("completions", "m", [1, 2, 3], 16, 0.0, ignore_eos=True)
    assert completion["prompt"] == [1, 2, 3] and completion["ignore_eos"] is True
    assert completion["stream"] is True and completion["stream_options"] == {"include_usage": True}
    chat = build_payload("chat", "m", "hi", 16, 0.5, ignore_eos=False)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in chat
    assert chat["max_completion_tokens"] == 16 and chat["temperature"] == 0.5


def test_launch_reads_the_http_address_of_the_ready_line() -> None:
    ready = {"ready": True, "gateway": {"grpc": "127.0.0.1:1", "http": "127.0.0.1:8123"}}
    assert http_base_url(ready) == "http://127.0.0.1:8123"
    with pytest.raises(ValueError, match="HTTP"):
        http_base_url({"ready": True, "gateway": {"grpc": "127.0.0.1:1"}})
    assert up_command("tiny-llama", "disaggregated")[-6:] == [
        "--model",
        "tiny-llama",
        "--port",
        "0",
        "--http-port",
        "0",
    ]
    assert up_command("tiny-llama", "colocated")[-2:] == ["--mode", "colocated"]


def test_compare_table_divides_by_the_baseline() -> None:
    def result(tok_s: float) -> dict[str, Any]:
        stats = {"mean": 10.0, "p50": 9.0, "p90": 12.0, "p99": 15.0}
        return {
            "completed": 32,
            "failed": 0,
            "output_throughput": tok_s,
            "ttft_ms": stats,
            "tpot_ms": stats,
            "itl_ms": stats,
            "output_tokens_per_cpu_s": None,
            "prefix_hit_rate": 0.5 if tok_s > 1000 else None,
            "server_cpu_s": 2.0 if tok_s > 1000 else None,
            "server_run_queue_wait_s": 0.5,
        }

    text = table([("vllm", result(900.0)), ("pdserve", result(1350.0))], baseline="vllm")
    header, _, vllm_row, pdserve_row = (
        [c.strip() for c in row.strip("|").split("|")] for row in text.splitlines()
    )
    assert header[:4] == ["system", "ok/failed", "out tok/s", "x baseline"]
    assert vllm_row[:4] == ["vllm", "32/0", "900.0", "1.00"]
    assert pdserve_row[:4] == ["pdserve", "32/0", "1350.0", "1.50"] and pdserve_row[-2] == "-"
    assert (header[-3], vllm_row[-3], pdserve_row[-3]) == ("prefix hits", "-", "0.500")
    assert (header[-1], vllm_row[-1], pdserve_row[-1]) == ("wait/CPU-s", "-", "0.25")
    with pytest.raises(ValueError, match="baseline"):
        table([("vllm", result(1.0))], baseline="sglang")


def test_shared_prefix_requests_share_one_prefix_and_are_seeded() -> None:
    ids = np.arange(3, 500)
    warm, requests = shared_prefix_requests(8, 40, 5, 7, 0, ids)
    assert len(requests) == 8
    prefix = warm.prompt[:40]
    for request in [warm, *requests]:
        assert isinstance(request.prompt, list) and len(request.prompt) == 45
        assert request.prompt[:40] == prefix and (request.prompt_len, request.max_tokens) == (45, 7)
        assert all(3 <= i < 500 for i in request.prompt)
    assert len({tuple(r.prompt[40:]) for r in [warm, *requests]}) == 9  # own tokens differ
    assert shared_prefix_requests(8, 40, 5, 7, 0, ids) == (warm, requests)
    assert shared_prefix_requests(8, 40, 5, 7, 1, ids)[0].prompt[:40] != prefix


def test_shared_prefix_groups_spread_the_requests_evenly_in_a_seeded_order() -> None:
    ids = np.arange(3, 500)
    warm, requests = shared_prefix_requests(12, 40, 5, 7, 0, ids, groups=3)
    assert shared_prefix_requests(12, 40, 5, 7, 0, ids, groups=3) == (warm, requests)
    heads = [tuple(r.prompt[:40]) for r in requests]
    assert len(set(heads)) == 3 and sorted(heads.count(h) for h in set(heads)) == [4, 4, 4]
    assert tuple(warm.prompt[:40]) in heads
    assert heads != sorted(heads, key=heads.index), "the groups are interleaved, not in runs"
    assert [len(r.prompt) for r in requests] == [45] * 12
    with pytest.raises(ValueError, match="groups"):
        shared_prefix_requests(2, 4, 1, 1, 0, ids, groups=0)
    with pytest.raises(ValueError, match="prefix_groups"):
        BenchConfig(workload="shared-prefix", prefix_groups=0)


def test_mixed_prompts_depend_on_seed_and_index_only() -> None:
    ids = np.arange(3, 500)
    prompts = MixedPrompts(ids, 0, (6, 9), (50, 2))
    assert prompts.short(3) == MixedPrompts(ids, 0, (6, 9), (50, 2)).short(3)
    assert prompts.short(3) != prompts.short(4) and prompts.short(3) != MixedPrompts(
        ids, 1, (6, 9), (50, 2)
    ).short(3)
    assert (prompts.short(0).prompt_len, prompts.short(0).max_tokens) == (6, 9)
    assert (prompts.long(0).prompt_len, prompts.long(0).max_tokens, len(prompts.long(0).prompt)) == (
        50,
        2,
        50,
    )


def test_mixed_result_splits_short_streams_and_long_prompts() -> None:
    short = [record(0.01, 0.11, 11, itl_s=[0.01] * 10) for _ in range(4)]
    long = [record(0.5, 0.6, 2, itl_s=[0.1]), record(0.7, 0.8, 2, itl_s=[0.1])]
    result = mixed_result(MixedRun(short, long, 2.0), {}, None)
    assert result["completed"] == 6 and result["total_output_tokens"] == 48
    assert result["output_throughput"] == pytest.approx(24.0)
    assert result["itl_ms"]["p99"] == pytest.approx(10.0)  # the short streams' only
    assert result["tpot_ms"]["mean"] == pytest.approx(10.0)
    assert result["long"]["ttft_ms"]["p50"] == pytest.approx(600.0)
    assert result["short"]["completed"] == 4 and result["long"]["completed"] == 2
    assert "long prompts" in result["table"]


# -- chunk timing over a real socket -----------------------------------------------------------

FIRST_DELAY_S = 0.3
GAP_S = 0.1


async def _paced_completions(request: web.Request) -> web.StreamResponse:
    """Streams 3 chunks (first after FIRST_DELAY_S, then every GAP_S), a usage event and [DONE]."""
    body = await request.json()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await asyncio.sleep(FIRST_DELAY_S)
    for index, text in enumerate(["a", "", "bc"]):
        if index:
            await asyncio.sleep(GAP_S)
        event = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    usage = {
        "prompt_tokens": len(body["prompt"]),
        "completion_tokens": 4,
        "total_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": len(body["prompt"]) - 1},
    }
    await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
    return response


@pytest.fixture
def paced_server() -> Iterator[str]:
    """The paced SSE server on 127.0.0.1, on its own event loop in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_post("/v1/completions", _paced_completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, runner.addresses[0][1]

    runner, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_chunks_are_timed_and_arrivals_are_kept(paced_server: str) -> None:
    async def run() -> list[RequestRecord]:
        async with new_session(0) as session:
            requests = [BenchRequest([5, 6, 7], 3, 4), BenchRequest([5, 6], 2, 4)]
            target = Target(paced_server, "m", "completions")
            result = await run_requests(session, target, requests, [0.0, 0.5])
            return result.records

    records = asyncio.run(run())
    for rec in records:
        assert rec.success, rec.error
        assert FIRST_DELAY_S <= rec.ttft_s < FIRST_DELAY_S + 0.25
        # The empty chunk is a chunk too (vLLM's definition): two gaps.
        assert len(rec.itl_s) == 2 and all(GAP_S * 0.9 <= gap < GAP_S + 0.15 for gap in rec.itl_s)
        assert rec.latency_s == pytest.approx(rec.ttft_s + sum(rec.itl_s))
        assert rec.generated_text == "abc" and rec.num_chunks == 3 and rec.output_tokens == 4
    assert [r.prompt_len for r in records] == [3, 2]
    assert [r.cached_tokens for r in records] == [2, 1]
    assert records[1].start_s - records[0].start_s >= 0.5


def test_mixed_loops_are_closed_and_stop_at_the_deadline(paced_server: str) -> None:
    # Each request takes FIRST_DELAY_S + 2 * GAP_S = 0.5 s: in 0.8 s a loop starts 2 of them.
    async def run() -> MixedRun:
        async with new_session(0) as session:
            target = Target(paced_server, "m", "completions")
            prompts = MixedPrompts(np.arange(3, 100), 0, (4, 3), (9, 2))
            return await run_mixed(
                lambda request: send_request(session, target, request, None), prompts, 3, 0.8
            )

    run = asyncio.run(run())
    assert len(run.short) == 6 and len(run.long) == 2
    assert all(r.success for r in [*run.short, *run.long])
    assert {r.prompt_len for r in run.long} == {9} and {r.prompt_len for r in run.short} == {4}
    # One long prompt after another: the second starts once the first ended.
    first, second = sorted(run.long, key=lambda r: r.start_s)
    assert second.start_s >= first.start_s + first.latency_s
    assert 1.0 <= run.duration_s < 1.6


# -- a real run against pdserve's HTTP front ---------------------------------------------------


@pytest.fixture(scope="module")
def http_stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        "tiny-llama", cache_dir, tmp_path_factory.mktemp("bench-logs"), gateway_args=["--http-port", "0"]
    ).start()
    yield stack
    stack.stop()


RESULT_KEYS = {
    "settings",
    "duration_s",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "total_cached_tokens",
    "prefix_hit_rate",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2el_ms",
    "slo_ms",
    "good_requests",
    "goodput",
    "server_cpu_s",
    "output_tokens_per_cpu_s",
    "server_run_queue_wait_s",
    "server_processes",
    "errors",
    "requests",
}


def run_bench(stack: Stack, cache_dir: Path, *args: str) -> dict[str, Any]:
    assert stack.gateway is not None
    pids = [str(s.pid) for s in (stack.gateway, *stack.prefills, *stack.decodes)]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "bench",
            "--base-url",
            f"http://{stack.gateway.ready['http']}",
            "--server-pid",
            ",".join(pids),
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=service_env(cache_dir),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "requests:" in done.stderr  # the progress bar
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_bench_completions_against_pdserve(http_stack: Stack, cache_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    result = run_bench(
        http_stack,
        cache_dir,
        *("--num-prompts", "6", "--concurrency", "3", "--input-len", "12", "--output-len", "5"),
        *("--ignore-eos", "--slo", "ttft_ms=60000,tpot_ms=60000", "--output-file", str(out)),
    )
    assert json.loads(out.read_text()) == result
    assert set(result) == RESULT_KEYS
    assert result["settings"]["model"] == "tiny-llama"  # from GET /v1/models
    assert (result["completed"], result["failed"], result["errors"]) == (6, 0, [])
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (72, 30)
    assert [(r["prompt_len"], r["output_tokens"]) for r in result["requests"]] == [(12, 5)] * 6
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = result[key]
        assert set(stats) == {"mean", "p50", "p90", "p99"}
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] < 60000
    assert result["ttft_ms"]["p50"] < result["e2el_ms"]["p50"]
    assert result["output_throughput"] == pytest.approx(30 / result["duration_s"])
    assert result["request_throughput"] == pytest.approx(6 / result["duration_s"])
    assert result["good_requests"] == 6 and result["goodput"] == pytest.approx(result["request_throughput"])
    assert result["server_cpu_s"] > 0 and result["output_tokens_per_cpu_s"] > 0
    # Each server process on its own: the gateway, the prefill and the decode did work.
    processes = {p["pid"]: p for p in result["server_processes"]}
    for service in (http_stack.gateway, *http_stack.prefills, *http_stack.decodes):
        assert service is not None
        row = processes[service.pid]
        assert row["cpu_s"] > 0 and "pdserve" in row["command"]
        assert row["run_queue_wait_s"] is None or row["run_queue_wait_s"] >= 0
    assert result["server_cpu_s"] == pytest.approx(sum(p["cpu_s"] for p in processes.values()))
    assert_no_leaks(http_stack)


def test_bench_chat_with_poisson_arrivals(http_stack: Stack, cache_dir: Path) -> None:
    result = run_bench(
        http_stack,
        cache_dir,
        *("--endpoint", "chat", "--num-prompts", "4", "--request-rate", "20", "--seed", "1"),
        *("--input-len", "8", "--output-len", "4", "--ignore-eos", "--slo", "ttft_ms=0.001"),
    )
    assert result["completed"] == 4 and result["total_output_tokens"] == 16
    assert result["settings"]["request_rate"] == 20.0 and result["settings"]["endpoint"] == "chat"
    # Text prompts through the chat template: the server's prompt count includes the template.
    assert all(r["prompt_len"] > 8 for r in result["requests"])
    assert result["good_requests"] == 0 and result["goodput"] == 0.0
    assert_no_leaks(http_stack)


def test_bench_shared_prefix_and_mixed_against_pdserve(http_stack: Stack, cache_dir: Path) -> None:
    shared = run_bench(
        http_stack,
        cache_dir,
        *("--workload", "shared-prefix", "--prefix-len", "40", "--suffix-len", "4"),
        *("--prefix-output-len", "3", "--prefix-requests", "6", "--prefix-concurrency", "3", "--ignore-eos"),
    )
    assert (shared["completed"], shared["failed"], shared["total_output_tokens"]) == (6, 0, 18)
    assert [r["prompt_len"] for r in shared["requests"]] == [44] * 6
    # The warm-up cached the prefix's two whole blocks; every measured request reads them.
    assert [r["cached_tokens"] for r in shared["requests"]] == [32] * 6
    assert shared["prefix_hit_rate"] == pytest.approx(32 / 44)
    mixed = run_bench(
        http_stack,
        cache_dir,
        *("--workload", "mixed", "--mixed-duration-s", "2", "--mixed-streams", "2", "--ignore-eos"),
        *(
            "--mixed-input-len",
            "8",
            "--mixed-output-len",
            "6",
            "--long-input-len",
            "60",
            "--long-output-len",
            "2",
        ),
    )
    assert mixed["failed"] == 0 and mixed["long"]["completed"] >= 1 and mixed["short"]["completed"] >= 2
    long_rows = [r for r in mixed["requests"] if r["prompt_len"] == 60]
    assert len(long_rows) == mixed["long"]["completed"] and all(r["output_tokens"] == 2 for r in long_rows)
    assert all(r["output_tokens"] == 6 for r in mixed["requests"] if r["prompt_len"] == 8)
    assert mixed["long"]["ttft_ms"]["p50"] > 0 and mixed["itl_ms"]["p99"] > 0
    assert_no_leaks(http_stack)
