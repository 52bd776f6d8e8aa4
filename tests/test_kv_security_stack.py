"""KV confidentiality and integrity through real processes: a gateway, a prefill and a decode on
127.0.0.1 moving KV over gloo pairs; the attacker is this test, calling the internal RPCs directly.

- the reproduction: a Prefill of the attacker's own prompt, then PullKv of its KV naming the real
  decode's instance id and its live pair generation (and bumped ones): every user's stream stays
  exact, the decode's pair keeps working, and the attacker's pairs end at their send's timeout;
- bad generations are INVALID_ARGUMENT; a bad first token or a handle naming an unknown prefill
  is refused by the decode before it opens any connection;
- nothing of the prefill listens beyond its host, and its pair stores answer no outsider;
- a public error carries no internal address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest

from pdserve.kv.pair_secret import MAX_PAIR_GENERATION
from pdserve.kv.shared_memory import LOCK_SUFFIX, PREFIX
from pdserve.v1 import decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from tests.conftest import assert_no_leaks
from tests.grpc_client import expect_error, generate_many, make_request
from tests.stack import ServiceProcess, Stack, free_port, internal_aio_channel, scrape, service_env, wait_for
from tests.test_equivalence import reference_tokens

MODEL = "tiny-llama"
TRANSFER_TIMEOUT_S = 5.0
GREEDY = sampling_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    transfer = ["--transfer-timeout-s", str(TRANSFER_TIMEOUT_S), "--kv-backend", "gloo"]
    prefill_port = free_port()
    s = Stack(
        MODEL,
        cache_dir,
        tmp_path_factory.mktemp("kv-security-logs"),
        prefill_args=[*transfer, "--port", str(prefill_port)],
        decode_args=[*transfer, "--prefill", f"127.0.0.1:{prefill_port}"],
    )
    s.start()
    try:
        yield s
    finally:
        s.stop()


def decode_instance_id(decode: ServiceProcess) -> str:
    """The decode's instance id, as a process of its host can see it: its shared-memory lock file."""
    assert decode.popen is not None
    for opened in psutil.Process(decode.popen.pid).open_files():
        name = Path(opened.path).name
        if name.startswith(PREFIX) and name.endswith(LOCK_SUFFIX):
            return name.removeprefix(PREFIX).removesuffix(LOCK_SUFFIX)
    raise AssertionError("the decode holds no instance lock")


async def prefill(stack: Stack, prompt: list[int]) -> prefill_pb2.PrefillResponse:
    async with internal_aio_channel(stack.prefills[0].grpc) as channel:
        return await prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_pb2.PrefillRequest(request_id="attacker", prompt_token_ids=prompt, sampling=GREEDY)
        )


async def pull_code(stack: Stack, request: prefill_pb2.PullKvRequest) -> grpc.StatusCode:
    async with internal_aio_channel(stack.prefills[0].grpc) as channel:
        try:
            await prefill_pb2_grpc.PrefillStub(channel).PullKv(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def exact_streams(stack: Stack, model: Any, prompts: list[list[int]], max_tokens: int = 8) -> None:
    requests = [
        make_request(prompt_token_ids=p, max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        for p in prompts
    ]
    results = asyncio.run(generate_many(stack.address, requests))
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_tokens(model, prompt, max_tokens), prompt


def test_a_forged_pull_on_the_decodes_live_pair_leaves_every_stream_exact(
    stack: Stack, reference_models: Callable[[str], tuple[Any, Any]]
) -> None:
    model, _ = reference_models(MODEL)
    exact_streams(stack, model, [[5, 6, 7, 8, 9]])  # the decode now has a live pair, generation 1
    victim = decode_instance_id(stack.decodes[0])
    before = scrape(stack.prefills[0].metrics)
    for generation in (1, 2, 1000):  # the live generation, a bump, a jump
        own = asyncio.run(prefill(stack, [40, 41, 42, 43, 44, 45, 46]))
        request = prefill_pb2.PullKvRequest(
            handle_id=own.kv_handle.id,
            decode_instance_id=victim,
            pair_generation=generation,
            pair_secret=secrets.token_bytes(32),
        )
        assert asyncio.run(pull_code(stack, request)) == grpc.StatusCode.OK
    for generation in (0, MAX_PAIR_GENERATION + 1, (1 << 64) - 1):  # never breaks a pair
        own = asyncio.run(prefill(stack, [40, 41, 42]))
        request = prefill_pb2.PullKvRequest(
            handle_id=own.kv_handle.id,
            decode_instance_id=victim,
            pair_generation=generation,
            pair_secret=secrets.token_bytes(32),
        )
        assert asyncio.run(pull_code(stack, request)) == grpc.StatusCode.INVALID_ARGUMENT
        asyncio.run(release(stack, own.kv_handle.id))
    # The next users' streams, and the ones after them, continue from their own context.
    exact_streams(stack, model, [[11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]])
    exact_streams(stack, model, [[7, 7, 7, 7], [3, 1, 4, 1, 5, 9, 2, 6]])
    after = scrape(stack.prefills[0].metrics)
    assert (
        after["pdserve_kv_pulls_stale_generation_total"] == before["pdserve_kv_pulls_stale_generation_total"]
    )
    # The attacker's sends end at their timeout, their pairs with them; the decode's pair remains.
    assert wait_for(
        lambda: scrape(stack.prefills[0].metrics)["pdserve_kv_sends_in_flight"] == 0, 4 * TRANSFER_TIMEOUT_S
    )
    assert wait_for(lambda: scrape(stack.prefills[0].metrics)["pdserve_kv_pairs"] <= 1, 10)
    assert scrape(stack.decodes[0].metrics)["pdserve_kv_pairs"] == 1
    exact_streams(stack, model, [[9, 8, 7, 6]])
    assert_no_leaks(stack)


async def release(stack: Stack, handle_id: bytes) -> None:
    async with internal_aio_channel(stack.prefills[0].grpc) as channel:
        await prefill_pb2_grpc.PrefillStub(channel).ReleaseKv(
            prefill_pb2.ReleaseKvRequest(handle_id=handle_id)
        )


async def decode_code(stack: Stack, handle: kv_pb2.KvHandle, first_token: int) -> grpc.StatusCode:
    async with internal_aio_channel(stack.decodes[0].grpc) as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Decode(
            decode_pb2.DecodeRequest(
                request_id="t", kv_handle=handle, first_token_id=first_token, sampling=GREEDY
            )
        )
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_a_bad_first_token_or_an_unknown_prefill_is_refused_before_any_connection(stack: Stack) -> None:
    real = asyncio.run(prefill(stack, [4, 5, 6, 7]))
    before = scrape(stack.prefills[0].metrics)["pdserve_kv_pull_calls_total"]
    for token in (-1, 1 << 30):
        assert asyncio.run(decode_code(stack, real.kv_handle, token)) == grpc.StatusCode.INVALID_ARGUMENT
    elsewhere = kv_pb2.KvHandle()
    elsewhere.CopyFrom(real.kv_handle)
    elsewhere.prefill_address = "10.255.0.1:" + real.kv_handle.prefill_address.rpartition(":")[2]
    assert (
        asyncio.run(decode_code(stack, elsewhere, real.first_token_id)) == grpc.StatusCode.PERMISSION_DENIED
    )
    loopback = kv_pb2.KvHandle()
    loopback.CopyFrom(real.kv_handle)
    loopback.prefill_address = "127.0.0.2:" + real.kv_handle.prefill_address.rpartition(":")[2]
    assert asyncio.run(decode_code(stack, loopback, real.first_token_id)) == grpc.StatusCode.PERMISSION_DENIED
    assert scrape(stack.prefills[0].metrics)["pdserve_kv_pull_calls_total"] == before
    assert asyncio.run(decode_code(stack, real.kv_handle, real.first_token_id)) == grpc.StatusCode.OK
    assert_no_leaks(stack)


def _loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def test_the_prefill_listens_only_on_its_host_and_its_pair_stores_answer_no_outsider(stack: Stack) -> None:
    service = stack.prefills[0]
    assert service.popen is not None
    listening = [
        c.laddr
        for c in psutil.Process(service.popen.pid).net_connections(kind="inet")
        if c.status == "LISTEN"
    ]
    assert listening and all(_loopback(address.ip) for address in listening), listening
    victim = decode_instance_id(stack.decodes[0])

    async def store_codes() -> list[grpc.StatusCode]:
        codes = []
        async with internal_aio_channel(service.grpc) as channel:
            stub = prefill_pb2_grpc.PrefillStub(channel)
            for op, secret in (
                ("get", secrets.token_bytes(32)),
                ("set", secrets.token_bytes(32)),
                ("get", b""),
            ):
                request = prefill_pb2.PairStoreRequest(
                    decode_instance_id=victim, pair_secret=secret, pair_generation=1, op=op, keys=["k"]
                )
                try:
                    await stub.PairStore(request, timeout=10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
        return codes

    assert asyncio.run(store_codes()) == [
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.INVALID_ARGUMENT,
    ]


def test_a_public_error_carries_no_internal_address(stack: Stack, tmp_path: Path, cache_dir: Path) -> None:
    """A gateway whose decode is nowhere: the client is told UNAVAILABLE and its request id, the
    gateway's log has the addresses."""
    nowhere = f"127.0.0.1:{free_port()}"
    gateway = ServiceProcess(
        "gateway",
        [
            *("--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--http-port", "-1"),
            *("--prefill", stack.prefills[0].grpc, "--decode", nowhere),
        ],
        service_env(cache_dir),
        tmp_path / "gateway.log",
    )
    gateway.start()
    try:
        gateway.wait_ready()
        request = make_request(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
        request.request_id = "public-1"
        started = time.monotonic()
        error = expect_error(gateway.grpc, request)
        assert time.monotonic() - started < 60
        details = error.details() or ""
        assert "public-1" in details, details
        for internal in (nowhere, stack.prefills[0].grpc, "127.0.0.1"):
            assert internal not in details, details
    finally:
        gateway.stop()
    assert nowhere in (tmp_path / "gateway.log").read_text()
    assert_no_leaks(stack)
