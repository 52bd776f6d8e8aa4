"""A decode under load through real processes: a request pulls its KV only once the decode can
admit it soon (until then its KV stays parked on the prefill), and one beyond the decode's bound on
the requests it holds is refused at once, RESOURCE_EXHAUSTED, which the gateway sheds to its
client; nothing left parked, pulled or running afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.conftest import assert_no_leaks
from tests.grpc_client import Stream, make_request
from tests.stack import Stack, scrape

LONG = 600


@pytest.fixture(scope="module")
def stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        "tiny-llama",
        cache_dir,
        tmp_path_factory.mktemp("decode-overload-logs"),
        decode_args=["--max-running", "1", "--max-pulled-waiting", "1", "--max-decode-waiting", "2"],
    ).start()
    yield stack
    stack.stop()


def metric(address: str, name: str) -> float:
    return scrape(address).get(name, 0.0)


async def until(predicate: object, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await asyncio.to_thread(predicate):  # type: ignore[arg-type]
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_kv_is_pulled_only_when_the_decode_can_admit_and_a_full_decode_sheds(stack: Stack) -> None:
    decode, prefill = stack.decodes[0].metrics, stack.prefills[0].metrics
    assert stack.gateway is not None
    request = make_request(prompt_token_ids=[5, 17, 99], max_tokens=LONG, temperature=0.0, ignore_eos=True)

    async def scenario() -> Stream:
        running = Stream(stack.address, request)
        await until(lambda: metric(decode, "pdserve_decode_running") == 1)
        pulled = Stream(stack.address, request)  # pulled, waits for the running set
        await until(lambda: metric(decode, "pdserve_decode_waiting") == 1)
        parked = Stream(stack.address, request)  # waits without pulling: its KV stays on the prefill
        await until(lambda: metric(decode, "pdserve_decode_pull_waiting") == 1)
        assert metric(prefill, "pdserve_kv_parked_handles") == 1
        assert metric(decode, "pdserve_decode_waiting") == 1
        refused = Stream(stack.address, request)  # the decode holds 2 that wait: refused at once
        await refused.task
        for s in (running, pulled, parked):
            assert not s.task.done() and s.error is None
            s.task.cancel()
        await asyncio.gather(running.task, pulled.task, parked.task, return_exceptions=True)
        return refused

    refused = asyncio.run(scenario())
    assert refused.error is not None and refused.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "the decode holds 2 requests" in (refused.error.details() or "")
    assert metric(decode, "pdserve_decode_shed_total") == 1
    assert metric(stack.gateway.metrics, "pdserve_gateway_shed_total{stage=decode}") == 1
    assert_no_leaks(stack)
    assert metric(decode, "pdserve_decode_pull_waiting") == 0
