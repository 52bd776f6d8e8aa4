"""Failures of the KV handoff are bounded and loud, and nobody needs a restart after a peer dies.

One stack of tiny-llama with 2 prefills and 2 decodes on fixed ports (so a killed process comes
back on its address) and a 3 s transfer timeout. Mid-transfer points are reached without sleeps:
scripted peers (``tests.kv_peer``) use the real PairChannel and stop at an exact step, and real
services are SIGSTOPped or SIGKILLed while a request is known to be at a given stage.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from decode_service.kv_puller import KvPuller
from decode_service.metrics import DecodeMetrics
from pdserve.core.sampling import SamplingParams
from pdserve.kv.handle import HandleIssuer
from pdserve.kv.layout import KvLayout, pack, unpack
from pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    kv_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    sampling_pb2,
)
from prefill_service.kv_registry import KvRegistry
from prefill_service.kv_sender import KvSender
from prefill_service.metrics import PrefillMetrics
from prefill_service.servicer import KvHandoffServicer
from tests.conftest import assert_no_leaks
from tests.grpc_client import Stream, generate_many, make_request
from tests.kv_peer import Peer
from tests.stack import ServiceProcess, Stack, free_port, internal_aio_channel, scrape, wait_for
from tests.test_equivalence import reference_tokens
from tests.test_sampled_stack import one_process

MODEL = "tiny-llama"
TRANSFER_TIMEOUT_S = 3.0
BOUND_S = TRANSFER_TIMEOUT_S + 2.0  # every failure below must be reported within this
GREEDY = sampling_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
CPU = torch.device("cpu")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=["gloo", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every failure below runs with the KV over a gloo pair and over shared memory."""
    return str(request.param)


@pytest.fixture(scope="module")
def stack(transport: str, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    timeout = ["--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--kv-backend", transport]
    s = Stack(
        MODEL,
        cache_dir,
        tmp_path_factory.mktemp(f"failure-logs-{transport}"),
        num_prefill=2,
        num_decode=2,
        prefill_args=timeout,
        decode_args=timeout,
    )
    for service in (*s.prefills, *s.decodes):
        service.args += ["--port", str(free_port())]
    try:
        yield s.start()
    finally:
        s.stop()


def _restart(service: ServiceProcess) -> None:
    assert service.popen is not None
    service.popen.wait(30)
    service.start()
    service.wait_ready()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _prefill(service: ServiceProcess, prompt: list[int]) -> prefill_pb2.PrefillResponse:
    async with internal_aio_channel(service.grpc) as channel:
        return await prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_pb2.PrefillRequest(request_id="t", prompt_token_ids=prompt, sampling=GREEDY)
        )


async def _decode(service: ServiceProcess, handle: kv_pb2.KvHandle, first_token: int) -> list[int]:
    async with internal_aio_channel(service.grpc) as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Decode(
            decode_pb2.DecodeRequest(
                request_id="t", kv_handle=handle, first_token_id=first_token, sampling=GREEDY
            )
        )
        return [t async for chunk in call for t in chunk.token_ids]


def _assert_kv_matches(path: Path, handle: kv_pb2.KvHandle, model: Any, prompt: list[int]) -> None:
    with torch.no_grad():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    layout = KvLayout.from_cache_layers(layers)
    assert [s.to_proto() for s in layout.tensor_specs(len(prompt))] == list(handle.tensors)
    received = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    for (k, v), (rk, rv) in zip(layers, unpack(received, layout, len(prompt)), strict=True):
        torch.testing.assert_close(rk, k[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(rv, v[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("transport", ["gloo"], indirect=True)
def test_decode_killed_mid_transfer_frees_the_kv_and_the_pair_comes_back(
    stack: Stack, reference_models: Any, tmp_path: Path
) -> None:
    prefill = stack.prefills[0]
    before = scrape(prefill.metrics)
    prompt = _prompt(37, 1)
    first = asyncio.run(_prefill(prefill, prompt))
    handle_hex = first.kv_handle.SerializeToString().hex()

    victim = Peer("decode")
    try:
        assert victim.ask("pull", "decode-a", handle_hex, "1") == {
            "ok": True,
            "num_bytes": first.kv_handle.num_bytes,
        }
        assert victim.ask("connect", "decode-a", handle_hex, "1") == {"ok": True}
        m = scrape(prefill.metrics)
        assert m["pdserve_kv_sends_in_flight"] == 1, "the send waits for the decode's receive"
        assert m["pdserve_kv_parked_handles"] == 0, "the pull took the handle"
        assert m["pdserve_kv_pairs"] == before["pdserve_kv_pairs"] + 1
        killed = time.monotonic()
        victim.kill()
        assert wait_for(lambda: scrape(prefill.metrics)["pdserve_kv_sends_in_flight"] == 0, BOUND_S)
        assert time.monotonic() - killed < BOUND_S
    finally:
        victim.kill()
    m = scrape(prefill.metrics)
    assert m["pdserve_kv_pull_failures_total"] == before["pdserve_kv_pull_failures_total"] + 1
    assert m["pdserve_kv_pairs"] == before["pdserve_kv_pairs"], "the failed pair is torn down"
    assert m["pdserve_kv_pair_rebuilds_total"] == before["pdserve_kv_pair_rebuilds_total"] + 1
    assert m["pdserve_kv_parked_bytes"] == 0

    model, _ = reference_models(MODEL)
    peer = Peer("decode")
    try:
        # The same decode instance comes back: its old generation is refused before the handle
        # is touched, and the next generation builds a new pair that moves the KV intact.
        second = asyncio.run(_prefill(prefill, prompt))
        hex2 = second.kv_handle.SerializeToString().hex()
        assert peer.ask("pull", "decode-a", hex2, "1") == {
            "ok": False,
            "code": "ABORTED",
            "min_generation": 2,
        }
        assert scrape(prefill.metrics)["pdserve_kv_parked_handles"] == 1
        assert peer.ask("pull", "decode-a", hex2, "2")["ok"]
        assert peer.ask("recv", "decode-a", hex2, "2", str(tmp_path / "a2")) == {"ok": True}
        _assert_kv_matches(tmp_path / "a2", second.kv_handle, model, prompt)
        # A restarted decode has a new instance id: a new pair, generation 1.
        third = asyncio.run(_prefill(prefill, prompt[:9]))
        hex3 = third.kv_handle.SerializeToString().hex()
        assert peer.ask("pull", "decode-b", hex3, "1")["ok"]
        assert peer.ask("recv", "decode-b", hex3, "1", str(tmp_path / "b1")) == {"ok": True}
        _assert_kv_matches(tmp_path / "b1", third.kv_handle, model, prompt[:9])
        assert scrape(prefill.metrics)["pdserve_kv_pairs"] == before["pdserve_kv_pairs"] + 2
    finally:
        peer.kill()
    # The prefill serves real decodes as before.
    results = asyncio.run(
        generate_many(
            stack.address, [make_request(prompt_token_ids=prompt, max_tokens=5, ignore_eos=True)] * 2
        )
    )
    assert all(len(r.token_ids) == 5 for r in results)
    assert_no_leaks(stack)


@pytest.mark.parametrize("transport", ["shm"], indirect=True)
def test_a_decode_killed_holding_a_lent_kv_has_it_freed_in_bound(
    stack: Stack, reference_models: Any, tmp_path: Path
) -> None:
    prefill = stack.prefills[0]
    before = scrape(prefill.metrics)
    prompt = _prompt(29, 5)
    first = asyncio.run(_prefill(prefill, prompt))
    assert list(first.kv_handle.transports) == ["shm"]
    victim = Peer("decode")
    try:
        handle_hex = first.kv_handle.SerializeToString().hex()
        assert victim.ask("borrow", secrets.token_hex(16), handle_hex, str(tmp_path / "lent")) == {
            "ok": True,
            "num_bytes": first.kv_handle.num_bytes,
        }
        model, _ = reference_models(MODEL)
        _assert_kv_matches(tmp_path / "lent", first.kv_handle, model, prompt)
        m = scrape(prefill.metrics)
        assert (m["pdserve_kv_lent_handles"], m["pdserve_kv_parked_handles"]) == (1, 0)
        assert m["pdserve_kv_arena_used_bytes"] >= first.kv_handle.num_bytes
        killed = time.monotonic()
        victim.kill()
        assert wait_for(lambda: scrape(prefill.metrics)["pdserve_kv_lent_handles"] == 0, BOUND_S)
        assert time.monotonic() - killed < BOUND_S
    finally:
        victim.kill()
    m = scrape(prefill.metrics)
    assert m["pdserve_kv_reclaimed_total"] == before["pdserve_kv_reclaimed_total"] + 1
    assert m["pdserve_kv_arena_used_bytes"] == before["pdserve_kv_arena_used_bytes"]
    results = asyncio.run(
        generate_many(
            stack.address, [make_request(prompt_token_ids=prompt, max_tokens=5, ignore_eos=True)] * 2
        )
    )
    assert all(len(r.token_ids) == 5 for r in results)
    assert_no_leaks(stack)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_prefill_killed_or_hung_mid_transfer_fails_the_pull_in_bound(
    stack: Stack, transport: str, how: str
) -> None:
    """Over gloo the prefill dies or hangs while the decode's receive waits on the pair; over shm it
    dies or hangs before it answers the pull. Either way the pull fails in bound."""
    decode = stack.decodes[0]
    real = asyncio.run(_prefill(stack.prefills[0], _prompt(20, 2)))
    asyncio.run(_release(stack.prefills[0], real.kv_handle.id))
    silent = Peer("prefill", str(real.kv_handle.num_bytes))
    try:
        where = silent.next_message()
        handle = kv_pb2.KvHandle()
        handle.CopyFrom(real.kv_handle)
        handle.id = secrets.token_bytes(16)
        handle.prefill_address = where["grpc"]
        handle.prefill_instance_id = where["instance_id"]
        before = scrape(decode.metrics)

        async def scenario() -> tuple[grpc.StatusCode, str, float]:
            call = asyncio.ensure_future(_decode(decode, handle, real.first_token_id))
            pulled = await asyncio.to_thread(silent.next_message)
            assert pulled["pulled"]
            if transport == "gloo":
                assert pulled["generation"] >= 1
                during = scrape(decode.metrics)
                assert during["pdserve_kv_receives_in_flight"] == 1
                assert during["pdserve_kv_pairs"] == before["pdserve_kv_pairs"] + 1
            start = time.monotonic()
            silent.popen.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            return info.value.code(), info.value.details() or "", time.monotonic() - start

        code, details, elapsed = asyncio.run(scenario())
    finally:
        silent.kill()
    assert code == grpc.StatusCode.ABORTED, details
    assert ("KV transfer from prefill" if transport == "gloo" else "PullKvMany on prefill") in details
    assert elapsed < BOUND_S, f"the decode reported the failure after {elapsed:.1f} s"
    m = scrape(decode.metrics)
    assert m["pdserve_kv_receives_in_flight"] == 0
    assert m["pdserve_kv_pairs"] == before["pdserve_kv_pairs"], "the failed pair is closed"
    assert m["pdserve_kv_pull_failures_total"] == before["pdserve_kv_pull_failures_total"] + 1
    # The decode keeps serving.
    result = asyncio.run(
        generate_many(
            stack.address, [make_request(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)]
        )
    )
    assert len(result[0].token_ids) == 4
    assert_no_leaks(stack)


async def _release(service: ServiceProcess, handle_id: bytes) -> None:
    async with internal_aio_channel(service.grpc) as channel:
        await prefill_pb2_grpc.PrefillStub(channel).ReleaseKv(
            prefill_pb2.ReleaseKvRequest(handle_id=handle_id)
        )


def test_a_flood_of_unknown_handles_is_refused_without_harm(stack: Stack) -> None:
    prefill, decode = stack.prefills[1], stack.decodes[1]
    real = asyncio.run(_prefill(prefill, _prompt(12, 3)))
    asyncio.run(_release(prefill, real.kv_handle.id))
    before_p, before_d = scrape(prefill.metrics), scrape(decode.metrics)

    async def flood() -> list[grpc.StatusCode]:
        async with internal_aio_channel(prefill.grpc) as channel:
            stub = prefill_pb2_grpc.PrefillStub(channel)

            async def pull(i: int) -> grpc.StatusCode:
                request = prefill_pb2.PullKvRequest(
                    handle_id=secrets.token_bytes(16 if i % 4 else 7),
                    decode_instance_id=f"stranger-{i}",
                    pair_generation=i % 5,
                    pair_secret=secrets.token_bytes(32),
                )
                try:
                    await stub.PullKv(request, timeout=10)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            direct = await asyncio.gather(*(pull(i) for i in range(200)))

        async def via_decode() -> grpc.StatusCode:
            handle = kv_pb2.KvHandle()
            handle.CopyFrom(real.kv_handle)
            handle.id = secrets.token_bytes(16)
            try:
                await _decode(decode, handle, real.first_token_id)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

        return [*direct, *await asyncio.gather(*(via_decode() for _ in range(20)))]

    codes = asyncio.run(flood())
    assert set(codes) == {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT}
    assert (
        codes.count(grpc.StatusCode.NOT_FOUND) == 200 - 50 - 30 + 20
    )  # 50 short ids, 30 more with generation 0
    after_p, after_d = scrape(prefill.metrics), scrape(decode.metrics)
    for name in ("pdserve_kv_pairs", "pdserve_kv_transfer_threads", "pdserve_kv_parked_handles"):
        assert after_p[name] == before_p[name], name
    assert after_d["pdserve_kv_transfer_threads"] == before_d["pdserve_kv_transfer_threads"]
    assert after_d["pdserve_kv_pairs"] <= before_d["pdserve_kv_pairs"] + 1
    assert after_p["pdserve_kv_pulls_not_found_total"] == before_p["pdserve_kv_pulls_not_found_total"] + 140
    result = asyncio.run(
        generate_many(
            stack.address, [make_request(prompt_token_ids=[9, 8, 7], max_tokens=4, ignore_eos=True)] * 2
        )
    )
    assert all(len(r.token_ids) == 4 for r in result)
    assert_no_leaks(stack)


async def _until(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the scenario to reach its next step"
        await asyncio.sleep(0.02)


def _gateway_metrics(stack: Stack) -> dict[str, float]:
    assert stack.gateway is not None
    return scrape(stack.gateway.metrics)


def _serving(stack: Stack, role: str) -> float:
    return _gateway_metrics(stack)[f"pdserve_gateway_backends_serving{{role={role}}}"]


def test_a_decode_killed_mid_stream_moves_its_streams_and_comes_back(
    stack: Stack, reference_models: Any
) -> None:
    model, _ = reference_models(MODEL)
    prompts = [_prompt(5 + i, 10 + i) for i in range(4)]
    requests = [
        make_request(prompt_token_ids=p, max_tokens=400, ignore_eos=True, temperature=0.0) for p in prompts
    ]
    before = _gateway_metrics(stack)["pdserve_gateway_retries_total{stage=decode}"]

    async def scenario() -> tuple[list[Stream], int]:
        streams = [Stream(stack.address, r) for r in requests]
        await _until(lambda: all(len(s.tokens) >= 3 for s in streams))
        running = [scrape(d.metrics)["pdserve_decode_running"] for d in stack.decodes]
        victim = 0 if running[0] >= running[1] else 1
        stack.decodes[victim].signal(signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 60)
        return streams, victim

    streams, victim = asyncio.run(scenario())
    moved = _gateway_metrics(stack)["pdserve_gateway_retries_total{stage=decode}"] - before
    assert moved >= 1, "the streams on the killed decode should have moved"
    # Every stream continues on the other decode, exactly as if nothing had happened.
    greedy = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for prompt, s in zip(prompts, streams, strict=True):
        assert s.error is None, s.error
        assert s.tokens == one_process(model, prompt, greedy, set())
    # New requests avoid the dead decode (or are run again elsewhere): they all complete.
    more = asyncio.run(
        generate_many(
            stack.address, [make_request(prompt_token_ids=[4, 5, 6], max_tokens=6, ignore_eos=True)] * 4
        )
    )
    assert all(len(r.token_ids) == 6 for r in more)
    assert wait_for(lambda: _serving(stack, "decode") == 1, 10)
    # The decode comes back on its address (a new instance): the gateway and the prefills take it again.
    _restart(stack.decodes[victim])
    assert wait_for(lambda: _serving(stack, "decode") == 2, 15)
    served = scrape(stack.decodes[victim].metrics)["pdserve_decode_requests_total"]
    assert served == 0
    results = asyncio.run(
        generate_many(
            stack.address,
            [make_request(prompt_token_ids=_prompt(9, i), max_tokens=5, ignore_eos=True) for i in range(6)],
        )
    )
    assert all(len(r.token_ids) == 5 for r in results)
    assert scrape(stack.decodes[victim].metrics)["pdserve_decode_requests_total"] > 0
    assert_no_leaks(stack)


def test_requests_on_a_hung_then_killed_prefill_run_again_elsewhere(
    stack: Stack, reference_models: Any
) -> None:
    model, _ = reference_models(MODEL)
    prompts = [_prompt(4 + 3 * i, 30 + i) for i in range(6)]
    before = _gateway_metrics(stack)["pdserve_gateway_retries_total{stage=prefill}"]
    hung = stack.prefills[1]
    hung.signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        results = asyncio.run(
            generate_many(
                stack.address,
                [make_request(prompt_token_ids=p, max_tokens=6, temperature=0.0) for p in prompts],
            )
        )
        elapsed = time.monotonic() - start
    finally:
        hung.signal(signal.SIGKILL)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_tokens(model, prompt, 6)
    retries = _gateway_metrics(stack)["pdserve_gateway_retries_total{stage=prefill}"] - before
    assert retries >= 1, "some requests went to the hung prefill and ran again on the other one"
    assert elapsed < 20, f"requests on the hung prefill took {elapsed:.1f} s"
    assert wait_for(lambda: _serving(stack, "prefill") == 1, 10)
    # The dead prefill is skipped: no more retries.
    more = asyncio.run(
        generate_many(
            stack.address, [make_request(prompt_token_ids=p, max_tokens=3, ignore_eos=True) for p in prompts]
        )
    )
    assert all(len(r.token_ids) == 3 for r in more)
    assert _gateway_metrics(stack)["pdserve_gateway_retries_total{stage=prefill}"] - before == retries
    _restart(hung)
    assert wait_for(lambda: _serving(stack, "prefill") == 2, 15)
    assert_no_leaks(stack)


def test_a_prefill_killed_while_its_kv_waits_for_the_pull_is_replaced(
    stack: Stack, reference_models: Any
) -> None:
    """Decodes held (SIGSTOP) while the request's first token streams; its prefill dies; the
    decode's pull fails (ABORTED) and the gateway runs the request again from the other prefill."""
    model, _ = reference_models(MODEL)
    prompt = _prompt(23, 40)
    before = _gateway_metrics(stack)["pdserve_gateway_retries_total{stage=decode}"]

    async def scenario() -> Stream:
        for d in stack.decodes:
            d.signal(signal.SIGSTOP)
        try:
            stream = Stream(
                stack.address, make_request(prompt_token_ids=prompt, max_tokens=12, temperature=0.0)
            )
            await _until(lambda: len(stream.tokens) >= 1)
            owner = next(p for p in stack.prefills if scrape(p.metrics)["pdserve_kv_parked_handles"] == 1)
            owner.signal(signal.SIGKILL)
        finally:
            for d in stack.decodes:
                d.signal(signal.SIGCONT)
        await asyncio.wait_for(stream.task, 60)
        return stream

    stream = asyncio.run(scenario())
    killed = next(p for p in stack.prefills if p.popen is not None and p.popen.poll() is not None)
    assert stream.error is None, stream.error
    assert stream.tokens == reference_tokens(model, prompt, 12)
    assert _gateway_metrics(stack)["pdserve_gateway_retries_total{stage=decode}"] == before + 1
    _restart(killed)
    assert wait_for(lambda: _serving(stack, "prefill") == 2, 15)
    assert_no_leaks(stack)


def test_a_decode_follows_the_prefill_to_a_newer_pair_generation() -> None:
    """Both sides in this process (real gRPC, store and gloo pairs): a pair the prefill tore down
    (idle past its time) is refused by generation, and the decode moves on to a new one."""
    timeout = timedelta(seconds=10)
    layout = KvLayout(keys=((2, 4),) * 2, values=((2, 3),) * 2, dtype=torch.float32)

    async def scenario() -> None:
        now = [0.0]
        metrics = PrefillMetrics(CollectorRegistry())
        registry = KvRegistry(60.0)
        sender = KvSender("prefill-x", "gloo", CPU, "127.0.0.1", timeout, metrics, 5.0, lambda: now[0])
        server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServicer_to_server(KvHandoffServicer(registry, sender, metrics), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pullers = [
            KvPuller(
                f"decode-{i}",
                "fp",
                layout,
                "gloo",
                CPU,
                "127.0.0.1",
                timeout,
                DecodeMetrics(CollectorRegistry()),
            )
            for i in (1, 2)
        ]

        template = HandleIssuer(
            prefill_address=f"127.0.0.1:{port}",
            prefill_instance_id="prefill-x",
            model_fingerprint="fp",
            layout=layout,
        )

        async def round_trip(puller: KvPuller, num_tokens: int) -> None:
            layers = [(torch.randn(1, 2, num_tokens, 4), torch.randn(1, 2, num_tokens, 3)) for _ in range(2)]
            entry = registry.park(pack(layers, layout, 0, 0, num_tokens, CPU), num_tokens)
            received = await puller.pull(template.issue(entry))
            for (k, v), (rk, rv) in zip(layers, received, strict=True):
                assert torch.equal(rk, k[0]) and torch.equal(rv, v[0])

        try:
            await round_trip(pullers[0], 3)
            await round_trip(pullers[0], 5)  # the pair is reused
            await _until(lambda: sender.num_in_flight == 0)  # the send's end is its last use
            now[0] += 10  # decode-1's pair has been idle past its time
            await round_trip(pullers[1], 4)  # a pull from another decode tears the idle pair down
            assert sender.num_pairs == 1
            await round_trip(pullers[0], 6)  # generation 1 is refused; decode-1 moves to 2
            stale = metrics.registry.get_sample_value("pdserve_kv_pulls_stale_generation_total")
            rebuilds = metrics.registry.get_sample_value("pdserve_kv_pair_rebuilds_total")
            assert (stale, rebuilds, sender.num_pairs) == (1, 1, 2)
            assert registry.num_parked == 0
            await _until(lambda: sender.num_in_flight == 0)
        finally:
            for puller in pullers:
                await puller.close()
            sender.close()
            await server.stop(0)

    asyncio.run(scenario())
