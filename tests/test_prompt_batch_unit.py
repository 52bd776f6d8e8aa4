"""A batch of prompts in one completions request (``gateway.prompt_batch``): choices renumbered
prompt by prompt, a stream started only once every prompt has answered, and a prompt's late
failure raised before the stream starts, with the other prompts closed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

import grpc
import pytest

from gateway.prompt_batch import batched, prompt_request_id, started
from pdserve.rpc.errors import RpcError
from pdserve.v1 import gateway_pb2

Responses = AsyncGenerator[gateway_pb2.GenerateResponse, None]


async def _prompt(
    tag: int,
    choices: int,
    steps: int,
    ended: list[int],
    delay: float = 0.0,
    fail: bool = False,
    step_s: float = 0.0,
) -> Responses:
    """One prompt's responses: ``steps`` rounds of one response per choice, token ``tag``, a round
    every ``step_s``, the first after ``delay``."""
    try:
        await asyncio.sleep(delay)
        if fail:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"prompt {tag} is bad")
        for _ in range(steps):
            for index in range(choices):
                yield gateway_pb2.GenerateResponse(index=index, token_ids=[tag])
            await asyncio.sleep(step_s)
    finally:
        ended.append(tag)


def test_choices_are_numbered_prompt_by_prompt() -> None:
    async def main() -> list[tuple[int, int]]:
        ended: list[int] = []
        streams = [_prompt(tag, 2, 3, ended) for tag in (10, 20, 30)]
        return [(r.index, r.token_ids[0]) async for r in batched(streams, 2)]

    got = asyncio.run(main())
    assert sorted(set(got)) == [(0, 10), (1, 10), (2, 20), (3, 20), (4, 30), (5, 30)]
    assert len(got) == 18


def test_one_prompt_is_its_own_stream() -> None:
    stream = _prompt(1, 1, 1, [])
    assert batched([stream], 1) is stream
    assert prompt_request_id("cmpl-x", 0, 1) == "cmpl-x"
    assert [prompt_request_id("cmpl-x", p, 2) for p in (0, 1)] == ["cmpl-x-0", "cmpl-x-1"]


def test_a_stream_starts_once_every_prompt_has_answered() -> None:
    async def main() -> None:
        ended: list[int] = []
        responses = batched([_prompt(1, 1, 5, ended), _prompt(2, 1, 2, ended, delay=0.05)], 1)
        first, rest = await started(responses, 2, 1)
        assert first.token_ids == [1]
        tail = [r.token_ids[0] async for r in rest]
        assert 2 in tail and tail.count(1) == 4 and tail.count(2) == 2
        assert sorted(ended) == [1, 2]

    asyncio.run(main())


def test_a_late_failure_is_raised_before_the_stream_starts_and_closes_the_others() -> None:
    async def main() -> None:
        ended: list[int] = []
        slow = _prompt(1, 1, 1000, ended, step_s=0.01)  # 10 s unless closed
        responses = batched([slow, _prompt(2, 1, 1, ended, delay=0.05, fail=True)], 1)
        begun = time.monotonic()
        with pytest.raises(RpcError, match="prompt 2 is bad"):
            await started(responses, 2, 1)
        assert sorted(ended) == [1, 2]  # the first prompt's stream was closed, not left running
        assert time.monotonic() - begun < 5

    asyncio.run(main())
