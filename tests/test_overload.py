"""Admission control and overload through real processes: the gateway's in-flight bound answered
at once (RESOURCE_EXHAUSTED, HTTP 429 with Retry-After), a request deadline down to decode, a short
request admitted past a long one that waits for the KV pool, and the decode's batch context freed
once idle; nothing left parked or running afterwards."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import assert_no_leaks
from tests.grpc_client import Stream, expect_error, make_request
from tests.stack import Stack, internal_aio_channel, scrape, wait_for

MAX_IN_FLIGHT = 4
RETRY_AFTER_S = 2
PREFILL_WAITING = 2
LONG = 600  # tokens: 603 positions, 38 of the pool's 64 blocks


@pytest.fixture(scope="module")
def stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        "tiny-llama",
        cache_dir,
        tmp_path_factory.mktemp("overload-logs"),
        prefill_args=["--max-prefill-waiting", str(PREFILL_WAITING)],
        decode_args=["--max-running", "4", "--max-kv-tokens", "1024", "--context-idle-s", "0.5"],
        gateway_args=[
            "--http-port",
            "0",
            "--max-in-flight",
            str(MAX_IN_FLIGHT),
            "--retry-after-s",
            str(RETRY_AFTER_S),
        ],
    ).start()
    yield stack
    stack.stop()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "stack" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("stack"))


def long_request(max_tokens: int = LONG) -> object:
    return make_request(prompt_token_ids=[5, 17, 99], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def http_completion(stack: Stack, body: dict[str, object]) -> tuple[int, dict[str, str], dict[str, object]]:
    assert stack.gateway is not None
    request = urllib.request.Request(
        f"http://{stack.gateway.ready['http']}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return (
                response.status,
                {k.lower(): v for k, v in response.headers.items()},
                json.loads(response.read()),
            )
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, json.loads(error.read())


def decode_metric(stack: Stack, name: str) -> float:
    return scrape(stack.decodes[0].metrics).get(name, 0.0)


def test_a_full_gateway_answers_at_once_with_resource_exhausted_and_429(stack: Stack) -> None:
    async def scenario() -> None:
        streams = []
        for _ in range(MAX_IN_FLIGHT):  # one after the other: each holds a place
            streams.append(Stream(stack.address, long_request()))  # type: ignore[arg-type]
            for _ in range(400):
                if streams[-1].tokens or streams[-1].task.done():
                    break
                await asyncio.sleep(0.01)
            assert streams[-1].tokens, streams[-1].error
        try:
            started = time.monotonic()
            error = await asyncio.to_thread(expect_error, stack.address, long_request(2))  # type: ignore[arg-type]
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            assert "--max-in-flight" in (error.details() or "")
            status, headers, body = await asyncio.to_thread(
                http_completion, stack, {"prompt": "hi", "max_tokens": 2}
            )
            assert status == 429, body
            assert headers.get("retry-after") == str(RETRY_AFTER_S)
            assert body["error"]["code"] == "overloaded"  # type: ignore[index]
            assert time.monotonic() - started < 5.0  # answered at once, not queued behind the streams
        finally:
            for s in streams:
                s.task.cancel()
            await asyncio.gather(*(s.task for s in streams), return_exceptions=True)

    asyncio.run(scenario())
    assert stack.gateway is not None
    assert scrape(stack.gateway.metrics)["pdserve_gateway_shed_total{stage=gateway}"] >= 2
    status, _, body = http_completion(stack, {"prompt": "hi", "max_tokens": 2})
    assert status == 200, body  # places are given back when requests end


def test_a_batch_of_prompts_takes_a_place_each_all_or_none(stack: Stack) -> None:
    async def scenario() -> None:
        holder = Stream(stack.address, long_request())  # type: ignore[arg-type]
        try:
            for _ in range(400):
                if holder.tokens or holder.task.done():
                    break
                await asyncio.sleep(0.01)
            assert holder.tokens, holder.error
            batch = {"prompt": [[5, 6], [7, 8], [9, 10], [11, 12]], "max_tokens": 2}
            status, headers, body = await asyncio.to_thread(http_completion, stack, batch)
            assert status == 429, body  # three places are free: none is taken
            assert headers.get("retry-after") == str(RETRY_AFTER_S)
            status, _, body = await asyncio.to_thread(
                http_completion, stack, {**batch, "prompt": batch["prompt"][:PREFILL_WAITING]}
            )
            assert status == 200, body
            assert [c["index"] for c in body["choices"]] == [0, 1]  # type: ignore[index]
        finally:
            holder.task.cancel()
            await asyncio.gather(holder.task, return_exceptions=True)

    asyncio.run(scenario())
    status, _, body = http_completion(stack, {"prompt": [[5]] * (MAX_IN_FLIGHT + 1), "max_tokens": 1})
    assert status == 400 and "--max-in-flight" in body["error"]["message"], body  # type: ignore[index]
    assert stack.gateway is not None
    assert scrape(stack.gateway.metrics)["pdserve_gateway_admitted"] == 0  # every place given back


def test_an_http_timeout_reaches_decode_as_deadline_exceeded(stack: Stack) -> None:
    expired = decode_metric(stack, "pdserve_decode_deadline_expired_total")
    started = time.monotonic()
    status, _, body = http_completion(
        stack,
        {"prompt": [5, 17, 99], "max_tokens": LONG, "ignore_eos": True, "temperature": 0, "timeout": 0.4},
    )
    assert status == 504, body
    assert body["error"]["code"] == "timeout"  # type: ignore[index]
    assert time.monotonic() - started < 3.0
    assert wait_for(lambda: decode_metric(stack, "pdserve_decode_deadline_expired_total") > expired)


def test_a_grpc_deadline_leaves_nothing_parked_or_running(stack: Stack) -> None:
    request = long_request()
    started = time.monotonic()
    try:
        asyncio.run(_generate_with_timeout(stack.address, request, 0.3))
        raise AssertionError("the request should have run past its deadline")
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3.0
    assert_no_leaks(stack)


async def _generate_with_timeout(address: str, request: object, timeout_s: float) -> None:
    from pdserve.v1 import gateway_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        async for _ in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=timeout_s):
            pass


def test_a_short_request_is_admitted_past_a_long_one_waiting_for_the_pool(stack: Stack) -> None:
    bypassed = decode_metric(stack, "pdserve_decode_bypassed_total")

    async def scenario() -> tuple[Stream, Stream, Stream]:
        first = Stream(stack.address, long_request())  # type: ignore[arg-type]
        while not first.tokens and not first.task.done():
            await asyncio.sleep(0.01)
        second = Stream(stack.address, long_request())  # type: ignore[arg-type]  # does not fit beside it
        await asyncio.sleep(0.3)
        short = Stream(stack.address, long_request(5))  # type: ignore[arg-type]
        await asyncio.gather(first.task, second.task, short.task)
        return first, second, short

    first, second, short = asyncio.run(scenario())
    for s in (first, second, short):
        assert s.error is None, s.error
    assert len(first.tokens) == len(second.tokens) == LONG and len(short.tokens) == 5
    assert short.ended_at < first.ended_at, "the short request waited for the long one"
    assert first.tokens == second.tokens  # the long one that waited ran, exact
    assert decode_metric(stack, "pdserve_decode_bypassed_total") > bypassed


def test_the_batch_context_is_freed_after_a_burst(stack: Stack) -> None:
    """Down to what the decode reserved at start-up (a row of 256 positions for this pool)."""
    time.sleep(1.5)  # past --context-idle-s of whatever ran before
    reserved = decode_metric(stack, "pdserve_decode_batch_context_bytes")

    async def burst() -> float:
        streams: list[Stream] = []
        for _ in range(3):  # each after the one before has its first token: never past the prefill's bound
            streams.append(Stream(stack.address, long_request(150)))  # type: ignore[arg-type]
            while not streams[-1].tokens and not streams[-1].task.done():
                await asyncio.sleep(0.01)
        held = 0.0
        while not all(s.task.done() for s in streams):
            held = max(
                held, await asyncio.to_thread(decode_metric, stack, "pdserve_decode_batch_context_bytes")
            )
            await asyncio.sleep(0.05)
        for s in streams:
            assert s.error is None, s.error
        return held

    held = asyncio.run(burst())
    assert held > reserved > 0
    assert wait_for(
        lambda: decode_metric(stack, "pdserve_decode_batch_context_bytes") == reserved, timeout_s=10
    )


def test_a_full_prefill_queue_answers_at_once_with_resource_exhausted(stack: Stack) -> None:
    """Prefill calls (complete at their first token: nothing parked) beyond the queue bound."""
    from pdserve.v1 import prefill_pb2, prefill_pb2_grpc, sampling_pb2

    request = prefill_pb2.PrefillRequest(
        request_id="burst",
        prompt_token_ids=[(7 * i) % 500 + 1 for i in range(2000)],
        sampling=sampling_pb2.SamplingParams(max_tokens=1, temperature=0.0),
    )

    async def burst() -> list[grpc.StatusCode]:
        async with internal_aio_channel(stack.prefills[0].grpc) as channel:
            stub = prefill_pb2_grpc.PrefillStub(channel)

            async def one() -> grpc.StatusCode:
                try:
                    await stub.Prefill(request, timeout=60)
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    assert "prefill queue is full" in (exc.details() or ""), exc.details()
                    return exc.code()

            return list(await asyncio.gather(*(one() for _ in range(12))))

    codes = asyncio.run(burst())
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.count(grpc.StatusCode.OK) >= 1 + PREFILL_WAITING
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert scrape(stack.prefills[0].metrics)["pdserve_prefill_shed_total"] >= 1
