"""Expert parallelism (``--ep 2``) on CPU with gloo, exact against single-process ``model.generate``.

One stack of tiny-deepseek-moe: a prefill of 2 ranks and two decodes, one of 2 ranks and one plain,
so requests go EP=2 prefill -> EP=2 decode and EP=2 prefill -> EP=1 decode. ``pdserve up --mode
colocated --prefill-ep 2`` covers the co-located group. The last test kills a rank of the EP decode.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from tests.conftest import assert_no_leaks
from tests.grpc_client import Stream, generate_many, make_request
from tests.stack import REPO_ROOT, ServiceProcess, Stack, internal_aio_channel, scrape, service_env, wait_for
from tests.test_equivalence import divergence_report, reference_tokens
from tests.test_health_reflection import health
from tests.test_migration import reference_tokens as migration_reference
from tests.test_up import PDSERVE, pdserve_up, pid_alive

MODEL = "tiny-deepseek-moe"
EP_TIMEOUT_S = 5.0
GRACE_S = 3.0
KILL_BOUND_S = EP_TIMEOUT_S + 5.0

pytestmark = pytest.mark.timeout(300)


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def _ep_counts(addresses: list[str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for address in addresses:
        for name, value in scrape(address).items():
            if name.startswith("pdserve_ep_") and name.endswith("_total"):
                totals[name] = totals.get(name, 0.0) + value
    return totals


@pytest.fixture(scope="module")
def ep_stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    group = ["--ep-timeout-s", str(EP_TIMEOUT_S), "--grace-s", str(GRACE_S)]
    s = Stack(
        MODEL,
        cache_dir,
        tmp_path_factory.mktemp("ep-logs"),
        num_prefill=1,
        num_decode=2,
        prefill_args=["--ep", "2", *group],
        decode_args=group,
    )
    s.decodes[0].args += ["--ep", "2"]
    try:
        yield s.start()
    finally:
        s.stop()


def test_disaggregated_ep_groups_match_generate(ep_stack: Stack, reference_models: Any) -> None:
    model, _ = reference_models(MODEL)
    prefill, ep_decode, plain_decode = ep_stack.prefills[0], ep_stack.decodes[0], ep_stack.decodes[1]
    assert len(prefill.ready["ranks"]) == 2 and len(ep_decode.ready["ranks"]) == 2
    # Each prefill rank measured its forwards' fixed cost at start, in step with the other (on a
    # CPU the forward size follows the queue).
    assert all(scrape(a)["pdserve_prefill_forward_fixed_tokens"] > 0 for a in prefill.rank_metrics)
    assert len(set(prefill.rank_pids)) == 2 and "ranks" not in plain_decode.ready
    lengths = [1, 2, 5, 9, 17, 33, 60, 3, 12, 25, 7, 44]
    max_tokens = [24, 1, 16, 8, 20, 5, 12, 24, 2, 18, 9, 14]
    prompts = _prompts(11, lengths, model.config.vocab_size)
    requests = [
        make_request(prompt_token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True)
        for p, n in zip(prompts, max_tokens, strict=True)
    ]
    results = asyncio.run(generate_many(ep_stack.address, requests))
    for prompt, n, result in zip(prompts, max_tokens, results, strict=True):
        ref = reference_tokens(model, prompt, n)
        assert result.token_ids == ref, divergence_report(model, prompt, ref, result.token_ids)

    # Both prefill ranks prefilled and parked; both decodes (and both ranks of the EP one) decoded.
    parks = [scrape(a)["pdserve_kv_parks_total"] for a in prefill.rank_metrics]
    assert all(p > 0 for p in parks), f"KV parked per prefill rank: {parks}"
    decoded = [scrape(a)["pdserve_decode_requests_total"] for a in ep_decode.rank_metrics]
    assert all(d > 0 for d in decoded), f"requests per EP decode rank: {decoded}"
    assert scrape(plain_decode.metrics)["pdserve_decode_requests_total"] > 0
    # The edge cases of lockstep EP occurred: experts that got no token in some layer and step.
    counts = _ep_counts([*prefill.rank_metrics, *ep_decode.rank_metrics])
    assert counts["pdserve_ep_idle_experts_total"] > 0
    assert counts["pdserve_ep_moe_calls_total"] > 0
    assert_no_leaks(ep_stack)


def test_a_rank_with_no_requests_steps_with_a_filler(ep_stack: Stack, reference_models: Any) -> None:
    model, _ = reference_models(MODEL)
    prefill = ep_stack.prefills[0]
    before = _ep_counts(prefill.rank_metrics)["pdserve_ep_filler_forwards_total"]
    prompt = _prompts(5, [14], model.config.vocab_size)[0]
    result = asyncio.run(
        generate_many(
            ep_stack.address, [make_request(prompt_token_ids=prompt, max_tokens=3, temperature=0.0)]
        )
    )[0]
    assert result.token_ids == reference_tokens(model, prompt, 3)
    # One request, one prefill forward: the other rank ran a filler in step with it.
    assert _ep_counts(prefill.rank_metrics)["pdserve_ep_filler_forwards_total"] > before
    assert_no_leaks(ep_stack)


def test_up_starts_ep_groups_on_both_sides(cache_dir: Path, tmp_path: Path, reference_models: Any) -> None:
    model, _ = reference_models(MODEL)
    with pdserve_up(
        cache_dir,
        tmp_path / "up.log",
        "--model",
        MODEL,
        "--port",
        "0",
        "--prefill-ep",
        "2",
        "--decode-ep",
        "2",
    ) as (up, ready):
        for side in ("prefill", "decode"):
            ranks = ready[side][0]["ranks"]
            assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2, ranks
        prompt = _prompts(31, [21], model.config.vocab_size)[0]
        request = make_request(prompt_token_ids=prompt, max_tokens=10, temperature=0.0, ignore_eos=True)
        result = asyncio.run(generate_many(ready["gateway"]["grpc"], [request]))[0]
        assert result.token_ids == reference_tokens(model, prompt, 10)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        for side in ("prefill", "decode"):
            for rank in ready[side][0]["ranks"]:
                assert wait_for(lambda pid=rank["pid"]: not pid_alive(pid), 10), (
                    f"{side} rank {rank} outlived up"
                )


def test_ep_on_a_dense_model_is_a_usage_error(cache_dir: Path) -> None:
    run = subprocess.run(
        [*PDSERVE, "prefill", "--model", "tiny-llama", "--ep", "2"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=service_env(cache_dir),
        timeout=120,
    )
    assert run.returncode == 2
    assert "needs a mixture-of-experts model" in run.stderr


def test_colocated_ep_group_matches_generate(cache_dir: Path, tmp_path: Path, reference_models: Any) -> None:
    model, _ = reference_models(MODEL)
    with pdserve_up(
        cache_dir,
        tmp_path / "up.log",
        "--mode",
        "colocated",
        "--prefill-ep",
        "2",
        "--model",
        MODEL,
        "--port",
        "0",
    ) as (up, ready):
        service = ready["prefill"][0]
        ranks = service["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and len({r["pid"] for r in ranks}) == 2
        prompts = _prompts(23, [4, 30, 11, 57, 2, 19], model.config.vocab_size)
        max_tokens = [20, 6, 1, 13, 17, 9]
        requests = [
            make_request(prompt_token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True)
            for p, n in zip(prompts, max_tokens, strict=True)
        ]
        results = asyncio.run(generate_many(ready["gateway"]["grpc"], requests))
        for prompt, n, result in zip(prompts, max_tokens, results, strict=True):
            ref = reference_tokens(model, prompt, n)
            assert result.token_ids == ref, divergence_report(model, prompt, ref, result.token_ids)
        decode_metrics = [r["metrics"] for r in ranks]
        prefill_metrics = [r["prefill_metrics"] for r in ranks]
        assert all(scrape(a)["pdserve_kv_sent_bytes_total"] == 0 for a in prefill_metrics)
        counts = _ep_counts(decode_metrics)
        assert counts["pdserve_ep_idle_experts_total"] > 0 and counts["pdserve_ep_filler_forwards_total"] > 0

        def clean() -> bool:
            return all(scrape(a)["pdserve_kv_parked_handles"] == 0 for a in prefill_metrics) and all(
                scrape(a)["pdserve_decode_running"] == 0 and scrape(a)["pdserve_decode_kv_blocks_used"] == 0
                for a in decode_metrics
            )

        assert wait_for(clean, 15)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        for pid in (r["pid"] for r in ranks):
            assert wait_for(lambda pid=pid: not pid_alive(pid), 10), f"rank process {pid} outlived the stack"


def test_killing_a_rank_fails_its_group_within_a_bound_and_its_streams_move(
    ep_stack: Stack, reference_models: Any
) -> None:
    """The group reports NOT_SERVING within the bound and rank 0 exits 1; the streams it was
    decoding move to the plain decode and end exactly as an undisturbed run."""
    model, _ = reference_models(MODEL)
    ep_decode = ep_stack.decodes[0]
    requests = [
        make_request(prompt_token_ids=[5 + i, 9, 13], max_tokens=400, ignore_eos=True, temperature=0.0)
        for i in range(4)
    ]
    statuses: list[int] = []
    assert ep_stack.gateway is not None
    moved_before = scrape(ep_stack.gateway.metrics).get("pdserve_gateway_retries_total{stage=decode}", 0.0)

    async def scenario() -> tuple[list[Stream], float]:
        streams = [Stream(ep_stack.address, r) for r in requests]
        deadline = time.monotonic() + 60
        while not all(len(s.tokens) >= 3 for s in streams):
            assert time.monotonic() < deadline, "the streams did not start"
            await asyncio.sleep(0.02)
        killed_at = time.monotonic()
        os.kill(ep_decode.rank_pids[1], signal.SIGKILL)
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        while time.monotonic() < killed_at + KILL_BOUND_S and statuses[-1:] != [not_serving]:
            try:
                statuses.append(await asyncio.to_thread(health, ep_decode.grpc))
            except grpc.RpcError:
                break
            await asyncio.sleep(0.05)
        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 120)
        return streams, killed_at

    streams, _ = asyncio.run(scenario())
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses, f"health seen after the kill: {statuses}"
    moved = (
        scrape(ep_stack.gateway.metrics).get("pdserve_gateway_retries_total{stage=decode}", 0.0)
        - moved_before
    )
    assert moved >= 1, "the streams on the EP decode should have moved"
    for request, s in zip(requests, streams, strict=True):
        assert s.error is None, s.error.details()
        expected = migration_reference(model, list(request.prompt_token_ids), 400)
        assert s.tokens == expected, divergence_report(
            model, list(request.prompt_token_ids), expected, s.tokens
        )
    # Rank 0 of the broken group exits (1) after its grace period, so its supervisor can start it again.
    assert ep_decode.popen is not None
    assert ep_decode.popen.wait(GRACE_S + 15) == 1
    assert not pid_alive(ep_decode.rank_pids[1])
    # The plain decode serves new requests; the prefill group holds no KV.
    more = asyncio.run(
        generate_many(
            ep_stack.address, [make_request(prompt_token_ids=[4, 5, 6], max_tokens=5, ignore_eos=True)] * 3
        )
    )
    assert all(len(r.token_ids) == 5 for r in more)
    prefill = ep_stack.prefills[0]
    assert wait_for(
        lambda: all(scrape(a)["pdserve_kv_parked_handles"] == 0 for a in prefill.rank_metrics), 15
    )


def test_drain_waits_for_the_kv_parked_on_every_rank(cache_dir: Path, tmp_path: Path) -> None:
    """SIGTERM on rank 0 of a prefill group: it drains until the KV parked on rank 1 is gone too."""
    env = service_env(cache_dir)
    prefill = ServiceProcess(
        "prefill",
        ["--model", MODEL, "--host", "127.0.0.1", "--ep", "2", "--grace-s", "30"],
        env,
        tmp_path / "prefill.log",
    )
    prefill.start()
    prefill.wait_ready()
    try:
        sampling = sampling_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

        async def park() -> list[kv_pb2.KvHandle]:
            async with internal_aio_channel(prefill.grpc) as channel:
                stub = prefill_pb2_grpc.PrefillStub(channel)
                calls = [
                    stub.Prefill(
                        prefill_pb2.PrefillRequest(prompt_token_ids=[3 + i] * (20 + i), sampling=sampling)
                    )
                    for i in range(4)
                ]
                return [r.kv_handle for r in await asyncio.gather(*calls)]

        handles = asyncio.run(park())
        assert {h.rank for h in handles} == {0, 1}, [h.rank for h in handles]
        addresses = {h.rank: h.prefill_address for h in handles}
        assert addresses[0] != addresses[1] and prefill.grpc not in addresses.values()

        async def release(rank: int) -> None:
            for h in (h for h in handles if h.rank == rank):
                async with internal_aio_channel(h.prefill_address) as channel:
                    response = await prefill_pb2_grpc.PrefillStub(channel).ReleaseKv(
                        prefill_pb2.ReleaseKvRequest(handle_id=h.id)
                    )
                    assert response.released

        prefill.signal(signal.SIGTERM)
        assert wait_for(lambda: health(prefill.grpc) == health_pb2.HealthCheckResponse.NOT_SERVING, 10)
        asyncio.run(release(0))
        time.sleep(1.5)
        assert prefill.popen is not None and prefill.popen.poll() is None, (
            "rank 0 stopped with KV parked on rank 1"
        )
        asyncio.run(release(1))
        assert prefill.popen.wait(20) == 0
        for pid in prefill.rank_pids:
            assert wait_for(lambda pid=pid: not pid_alive(pid), 10)
    finally:
        prefill.stop()
