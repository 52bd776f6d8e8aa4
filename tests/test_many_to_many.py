"""Two prefills x two decodes: concurrent load with exact greedy equivalence, every (prefill, decode)
pair built and reused, and one pair's transfers never waiting on another's."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from gateway.backends import prefill_pool
from pdserve.rpc.errors import RpcError
from pdserve.rpc.server import ServiceServer
from pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from tests.conftest import assert_no_leaks
from tests.grpc_client import generate_many, make_request
from tests.kv_peer import Peer
from tests.stack import ServiceProcess, Stack, internal_aio_channel, scrape
from tests.test_equivalence import divergence_report, reference_tokens

MODEL = "tiny-llama"
NUM_REQUESTS = 24
PREFILL_SERVICE = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=["gloo", "auto"])
def transport(request: pytest.FixtureRequest) -> str:
    """--kv-backend of every service: gloo pairs, or auto (shared memory on one host)."""
    return str(request.param)


@pytest.fixture(scope="module")
def stack(transport: str, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    args = ["--kv-backend", transport]
    s = Stack(
        MODEL,
        cache_dir,
        tmp_path_factory.mktemp(f"m2m-logs-{transport}"),
        num_prefill=2,
        num_decode=2,
        prefill_args=args,
        decode_args=args,
    )
    try:
        yield s.start()
    finally:
        s.stop()


async def _prefill_then_decode(
    prefill: ServiceProcess, decode: ServiceProcess, prompt: list[int], max_tokens: int
) -> list[int]:
    sampling = sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    async with internal_aio_channel(prefill.grpc) as channel:
        first = await prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling=sampling)
        )
    async with internal_aio_channel(decode.grpc) as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Decode(
            decode_pb2.DecodeRequest(
                kv_handle=first.kv_handle, first_token_id=first.first_token_id, sampling=sampling
            )
        )
        return [first.first_token_id, *[t async for chunk in call for t in chunk.token_ids]]


def test_concurrent_load_over_two_prefills_and_two_decodes_is_exact(
    stack: Stack, transport: str, reference_models: Any
) -> None:
    model, _ = reference_models(MODEL)
    generator = torch.Generator().manual_seed(424242)
    lengths = torch.randint(1, 200, (NUM_REQUESTS,), generator=generator).tolist()
    max_tokens = torch.randint(2, 48, (NUM_REQUESTS,), generator=generator).tolist()
    prompts = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in lengths]
    requests = [
        make_request(prompt_token_ids=p, max_tokens=m, temperature=0.0)
        for p, m in zip(prompts, max_tokens, strict=True)
    ]
    results = asyncio.run(generate_many(stack.address, requests))
    continued = 0  # requests that went on past their first token: each one pulled its KV
    for prompt, m, result in zip(prompts, max_tokens, results, strict=True):
        ref = reference_tokens(model, prompt, m)
        assert result.token_ids == ref, divergence_report(model, prompt, ref, result.token_ids)
        continued += len(ref) > 1
    for service in stack.prefills:
        assert scrape(service.metrics)["pdserve_prefill_requests_total"] > 0, f"{service.grpc} served nothing"
    for service in stack.decodes:
        assert scrape(service.metrics)["pdserve_decode_requests_total"] > 0, f"{service.grpc} served nothing"
    assert sum(scrape(p.metrics)["pdserve_kv_pulls_total"] for p in stack.prefills) == continued

    # Every (prefill, decode) combination at once: each decode pulls from both prefills at the same
    # time and each prefill sends to both decodes at the same time, each over its own pair (gloo),
    # or lends to both at the same time (auto on one host: shared memory, no pair).
    combos = list(itertools.product(stack.prefills, stack.decodes))
    prompt = prompts[0]

    async def all_pairs() -> list[list[int]]:
        return list(await asyncio.gather(*(_prefill_then_decode(p, d, prompt, 10) for p, d in combos)))

    ref = reference_tokens(model, prompt, 10)
    assert all(tokens == ref for tokens in asyncio.run(all_pairs()))
    used = "gloo" if transport == "gloo" else "shm"
    for service in (*stack.prefills, *stack.decodes):
        m = scrape(service.metrics)
        pairs = 2 if used == "gloo" else 0
        assert m["pdserve_kv_pairs"] == pairs, f"{service.name} {service.grpc} should have {pairs} pairs"
        assert m[f"pdserve_kv_transport_pulls_total{{transport={used}}}"] > 0
        assert not any(f"transport={other}" in name for name in m for other in {"gloo", "shm"} - {used})
    rebuilds = sum(scrape(p.metrics)["pdserve_kv_pair_rebuilds_total"] for p in stack.prefills)
    assert rebuilds == 0, "pairs are built once and reused"
    assert_no_leaks(stack)


@pytest.mark.parametrize("transport", ["gloo"], indirect=True)
def test_a_send_stuck_on_one_decode_does_not_hold_another_decodes_transfers(
    stack: Stack, tmp_path: Path
) -> None:
    prefill, decode = stack.prefills[0], stack.decodes[0]
    sampling = sampling_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def park(prompt: list[int]) -> prefill_pb2.PrefillResponse:
        async with internal_aio_channel(prefill.grpc) as channel:
            return await prefill_pb2_grpc.PrefillStub(channel).Prefill(
                prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling=sampling)
            )

    stuck = asyncio.run(park([11, 12, 13, 14]))
    handle_hex = stuck.kv_handle.SerializeToString().hex()
    peer = Peer("decode")
    try:
        # A decode that pulls, builds its side of the pair and then does not receive (yet): the
        # prefill's send to it waits, up to the transfer timeout (30 s here).
        assert peer.ask("pull", "slow-decode", handle_hex, "1")["ok"]
        assert peer.ask("connect", "slow-decode", handle_hex, "1") == {"ok": True}
        assert scrape(prefill.metrics)["pdserve_kv_sends_in_flight"] == 1
        tokens = asyncio.run(_prefill_then_decode(prefill, decode, [21, 22, 23], 8))
        assert len(tokens) == 8, "the other decode's transfer went through meanwhile"
        assert scrape(prefill.metrics)["pdserve_kv_sends_in_flight"] == 1, "the stuck send still waits"
        assert peer.ask("recv", "slow-decode", handle_hex, "1", str(tmp_path / "kv")) == {"ok": True}
        assert (tmp_path / "kv").stat().st_size == stuck.kv_handle.num_bytes
        assert scrape(prefill.metrics)["pdserve_kv_sends_in_flight"] == 0

        # A decode that pulls but is late for the pair's rendezvous does not hold up the
        # rendezvous of another decode's new pair either.
        late = asyncio.run(park([31, 32]))
        late_hex = late.kv_handle.SerializeToString().hex()
        assert peer.ask("pull", "late-decode", late_hex, "1")["ok"]
        fresh = asyncio.run(park([41, 42, 43]))
        fresh_hex = fresh.kv_handle.SerializeToString().hex()
        start = time.monotonic()
        assert peer.ask("pull", "fresh-decode", fresh_hex, "1")["ok"]
        assert peer.ask("recv", "fresh-decode", fresh_hex, "1", str(tmp_path / "fresh")) == {"ok": True}
        assert time.monotonic() - start < 10, "the new pair waited on the late one (30 s timeout)"
        assert peer.ask("connect", "late-decode", late_hex, "1") == {"ok": True}
        assert peer.ask("recv", "late-decode", late_hex, "1", str(tmp_path / "late")) == {"ok": True}
        assert (tmp_path / "late").stat().st_size == late.kv_handle.num_bytes
    finally:
        peer.kill()
    assert_no_leaks(stack)


def test_the_pools_route_by_load_among_serving_backends_only() -> None:
    """Real gRPC servers with grpc.health.v1, in this process: the pool follows their health."""

    async def scenario() -> None:
        servers = [ServiceServer("127.0.0.1", 0, [PREFILL_SERVICE]) for _ in range(3)]
        for server in servers:
            await server.start()
        pool = prefill_pool([s.address for s in servers], pick_wait_s=2.0)
        try:
            await _until(lambda: pool.num_serving == 3)
            a, b, c = pool.backends
            a.outstanding, b.outstanding, c.outstanding = 2, 1, 1
            assert {(await pool.pick()).address for _ in range(4)} == {b.address, c.address}
            await servers[1].health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await _until(lambda: not b.health.serving)
            assert [await pool.pick() for _ in range(3)] == [c, c, c]
            assert await pool.pick(avoid=[c]) is a, "a backend the request failed on is avoided"
            await servers[2].server.stop(0)  # c is gone
            await _until(lambda: not c.health.serving)
            assert await pool.pick() is a
            await servers[0].health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await _until(lambda: pool.num_serving == 0)
            waiting = asyncio.ensure_future(pool.pick())
            await asyncio.sleep(0.3)
            assert not waiting.done(), "no backend is serving: the pick waits"
            await servers[1].health.set("", health_pb2.HealthCheckResponse.SERVING)
            assert await asyncio.wait_for(waiting, 2) is b
            await servers[1].health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await _until(lambda: pool.num_serving == 0)
            with pytest.raises(RpcError) as info:
                await pool.pick()
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            assert "no prefill is serving" in info.value.message
            assert all(s.address in info.value.message for s in servers)
        finally:
            await pool.close()
            for server in servers:
                await server.server.stop(0)

    asyncio.run(scenario())


async def _until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the pool did not see the change in time"
        await asyncio.sleep(0.02)
