"""The parts of ``n`` choices one by one: choice seeds, first tokens from one row of logits, one KV
under several handles (freed with the last), and the gateway's merge of the choices' streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import grpc
import pytest
import torch

from gateway.choice_streams import choice_answers, merged
from gateway.input_limits import InputLimits
from pdserve.config import RequestLimits
from pdserve.config.request_limits import MAX_CHOICES as CONFIG_MAX_CHOICES
from pdserve.core.choices import MAX_CHOICES, choice_params, choice_seed
from pdserve.core.sampling import SamplingParams, sample
from pdserve.rpc.errors import RpcError
from pdserve.rpc.sampling_proto import sampling_from_proto, sampling_to_proto
from pdserve.v1 import gateway_pb2, prefill_pb2, sampling_pb2
from prefill_service.first_choices import continues, first_tokens
from prefill_service.kv_registry import KvRegistry
from prefill_service.kv_shares import SharedFree
from prefill_service.kv_space import ParkedBuffer


def test_choice_seeds_follow_vllm_and_wrap() -> None:
    assert choice_seed(7, 0) == 7 and choice_seed(7, 3) == 10
    assert choice_seed(2**64 - 1, 2) == 1
    params = SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=3)
    assert [choice_params(params, i).seed for i in range(4)] == [5, 6, 7, 8]
    assert {choice_params(params, i).n for i in range(4)} == {1}
    assert choice_params(SamplingParams(temperature=0.0, n=3), 2).seed is None


def test_n_bounds() -> None:
    assert MAX_CHOICES == CONFIG_MAX_CHOICES
    for bad in (0, MAX_CHOICES + 1):
        with pytest.raises(ValueError, match=r"sampling\.n"):
            sampling_from_proto(sampling_pb2.SamplingParams(n=bad))
    assert sampling_from_proto(sampling_pb2.SamplingParams(n=3)).n == 3
    assert sampling_to_proto(SamplingParams(n=3)).n == 3
    assert not sampling_to_proto(SamplingParams()).HasField("n")
    inputs = InputLimits(RequestLimits(max_n=4))
    inputs.check_sampling(sampling_pb2.SamplingParams(n=4))
    for bad in (0, 5, 2**32 - 1):
        with pytest.raises(ValueError, match=r"^n must be in \[1, 4\]"):
            inputs.check_sampling(sampling_pb2.SamplingParams(n=bad))
    with pytest.raises(ValueError, match="max_n"):
        RequestLimits(max_n=MAX_CHOICES + 1)


def test_first_tokens_come_from_one_row() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    never = lambda token: ""  # noqa: E731
    greedy = first_tokens(logits, SamplingParams(temperature=0.0, n=3), 0, (), never)
    assert [t.token_id for t in greedy] == [int(logits.argmax())] * 3
    params = SamplingParams(temperature=2.0, seed=11, n=6)
    sampled = first_tokens(logits, params, 2, (), never)
    assert [t.token_id for t in sampled] == [
        sample(logits, choice_params(params, i), step=2) for i in range(6)
    ]
    assert len({t.token_id for t in sampled}) > 1
    single = first_tokens(logits, SamplingParams(temperature=2.0, seed=11), 2, (), never)
    assert single[0].token_id == sampled[0].token_id  # choice 0 is the request of that seed
    done = first_tokens(logits, SamplingParams(temperature=2.0, seed=11, n=3, max_tokens=1), 0, (), never)
    assert {t.finish_reason for t in done} == {"length"} and not continues(done)
    assert continues(sampled)


def test_shared_free_frees_with_the_last_share() -> None:
    freed: list[int] = []
    shared = SharedFree(lambda: freed.append(1), 3)
    shares = [shared.share() for _ in range(3)]
    shares[0]()
    shares[0]()  # a second free of one share counts nothing
    shares[1]()
    assert not freed and shared.shares_left == 1
    shares[2]()
    assert freed == [1]
    with pytest.raises(ValueError):
        SharedFree(lambda: None, 0)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_park_shared_handles_leave_one_by_one_and_free_once() -> None:
    clock = FakeClock()
    registry = KvRegistry(lease_s=10.0, clock=clock)
    freed: list[int] = []
    buffer = ParkedBuffer(torch.zeros(64, dtype=torch.uint8), ("gloo",))
    buffer.free = lambda: freed.append(1)  # type: ignore[method-assign]
    entries = registry.park_shared(buffer, num_tokens=4, count=3)
    assert len({e.handle_id for e in entries}) == 3
    assert registry.num_parked == 3 and registry.num_bytes_parked == 64  # one buffer
    taken = registry.take(entries[0].handle_id)
    assert taken is not None and taken.buffer is buffer.tensor
    assert registry.take(entries[0].handle_id) is None  # each handle leaves once
    assert registry.release(entries[1].handle_id)
    taken.free()  # the taker's send ended
    assert not freed and registry.num_parked == 1
    clock.now = 11.0
    assert [e.handle_id for e in registry.expire()] == [entries[2].handle_id]
    assert freed == [1] and registry.num_parked == 0 and registry.num_bytes_parked == 0


def test_choice_answers_split_the_prefill_answer() -> None:
    answer = prefill_pb2.PrefillResponse(queue_seconds=0.5)
    answer.choices.add(first_token_id=3, finish_reason="length")
    answer.choices.add(first_token_id=4, kv_handle={"num_tokens": 2})
    first, second = choice_answers(answer, 2)
    assert (first.first_token_id, first.finish_reason, first.HasField("kv_handle")) == (3, "length", False)
    assert second.kv_handle.num_tokens == 2 and second.queue_seconds == 0.5
    with pytest.raises(RpcError):
        choice_answers(answer, 3)


async def _stream(
    tokens: list[int], ended: list[int], delay: float = 0.0
) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
    try:
        for token in tokens:
            await asyncio.sleep(delay)
            yield gateway_pb2.GenerateResponse(token_ids=[token])
    finally:
        ended.append(tokens[0])


async def _failing() -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
    yield gateway_pb2.GenerateResponse(token_ids=[9])
    raise RpcError(grpc.StatusCode.UNAVAILABLE, "lost")


def test_merged_streams_carry_their_index_and_end_together() -> None:
    async def main() -> None:
        ended: list[int] = []
        got = [
            (r.index, r.token_ids[0])
            async for r in merged([_stream([1, 2], ended), _stream([5, 6, 7], ended)])
        ]
        assert [t for i, t in got if i == 0] == [1, 2] and [t for i, t in got if i == 1] == [5, 6, 7]
        assert sorted(ended) == [1, 5]
        # A failing choice fails the request and cancels the others.
        ended.clear()
        with pytest.raises(RpcError):
            async for _ in merged([_stream([1] * 100, ended, delay=0.01), _failing()]):
                pass
        assert ended == [1]
        # A client that goes away cancels every choice.
        ended.clear()
        stream = merged([_stream([1] * 100, ended, delay=0.01), _stream([2] * 100, ended, delay=0.01)])
        await anext(stream)
        await stream.aclose()
        assert sorted(ended) == [1, 2]

    asyncio.run(main())
