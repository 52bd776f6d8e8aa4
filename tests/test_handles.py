"""KV handles at the internal APIs: unknown or expired -> NOT_FOUND, another model ->
FAILED_PRECONDITION before any byte moves, malformed -> INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import grpc
import pytest

from pdserve.v1 import decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from tests.conftest import StackPool
from tests.stack import Stack, internal_aio_channel, scrape

MODEL = "tiny-llama"
GREEDY = sampling_pb2.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


async def prefill(stack: Stack, prompt: list[int]) -> prefill_pb2.PrefillResponse:
    async with internal_aio_channel(stack.prefills[0].grpc) as channel:
        return await prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_pb2.PrefillRequest(request_id="t", prompt_token_ids=prompt, sampling=GREEDY)
        )


async def release(stack: Stack, handle_id: bytes) -> bool:
    async with internal_aio_channel(stack.prefills[0].grpc) as channel:
        response = await prefill_pb2_grpc.PrefillStub(channel).ReleaseKv(
            prefill_pb2.ReleaseKvRequest(handle_id=handle_id)
        )
        return bool(response.released)


async def decode(stack: Stack, handle: kv_pb2.KvHandle, first_token: int) -> list[int]:
    async with internal_aio_channel(stack.decodes[0].grpc) as channel:
        call = decode_pb2_grpc.DecodeStub(channel).Decode(
            decode_pb2.DecodeRequest(
                request_id="t", kv_handle=handle, first_token_id=first_token, sampling=GREEDY
            )
        )
        return [t async for chunk in call for t in chunk.token_ids]


def decode_error(stack: Stack, handle: kv_pb2.KvHandle) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(decode(stack, handle, 1))
    return info.value


def test_handle_describes_the_kv(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)
    response = asyncio.run(prefill(stack, [4, 5, 6, 7, 8]))
    handle = response.kv_handle
    try:
        assert len(handle.id) == 16
        assert handle.num_tokens == 5
        assert handle.backend == "gloo"
        assert handle.prefill_address == stack.prefills[0].grpc
        assert handle.rendezvous_address == "" and "kv_rendezvous" not in stack.prefills[0].ready
        assert handle.model_fingerprint
        assert handle.expires_at_unix > time.time()
        names = [t.name for t in handle.tensors]
        assert names[:2] == ["layers.0.keys", "layers.0.values"]
        assert all(t.shape[1] == 5 and t.dtype == "float32" for t in handle.tensors)
        assert handle.num_bytes >= sum(4 * t.shape[0] * t.shape[1] * t.shape[2] for t in handle.tensors)
        # The decode continues from it: 7 more tokens after the first.
        assert len(asyncio.run(decode(stack, handle, response.first_token_id))) == 7
    finally:
        asyncio.run(release(stack, handle.id))


def test_handle_names_the_prefix_cache_blocks_of_its_prompt(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)
    prompt = [(7 * i + 11) % 400 + 3 for i in range(40)]  # 2 full blocks of 16
    response = asyncio.run(prefill(stack, prompt))
    handle = kv_pb2.KvHandle()
    handle.CopyFrom(response.kv_handle)
    try:
        assert handle.block_size == 16 and len(handle.block_ids) == 2
        again = asyncio.run(prefill(stack, prompt)).kv_handle  # its blocks, from the cache
        assert list(again.block_ids) == list(handle.block_ids)
        assert asyncio.run(release(stack, again.id))
        for tamper, message in (
            ("size", "block_size must be >= 1"),
            ("count", "cover at most its num_tokens"),
        ):
            bad = kv_pb2.KvHandle()
            bad.CopyFrom(handle)
            if tamper == "size":
                bad.block_size = 0
            else:
                bad.block_ids.extend([1, 2])
            error = decode_error(stack, bad)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (error.details() or "")
    finally:
        assert asyncio.run(release(stack, handle.id)), "the refused KV should still be parked"


def test_unknown_handle_is_not_found(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)
    response = asyncio.run(prefill(stack, [4, 5, 6]))
    handle = kv_pb2.KvHandle()
    handle.CopyFrom(response.kv_handle)
    assert asyncio.run(release(stack, handle.id))
    error = decode_error(stack, handle)  # released: now unknown
    assert error.code() == grpc.StatusCode.NOT_FOUND
    handle.id = secrets.token_bytes(16)
    assert decode_error(stack, handle).code() == grpc.StatusCode.NOT_FOUND
    assert not asyncio.run(release(stack, handle.id))


def test_expired_handle_is_not_found(eos_stack: Any) -> None:
    stack, _ = eos_stack  # leases of 1 s
    before = scrape(stack.prefills[0].metrics)["pdserve_kv_expiries_total"]
    response = asyncio.run(prefill(stack, [40, 41, 42, 43]))
    assert response.HasField("kv_handle")
    time.sleep(1.6)
    metrics = scrape(stack.prefills[0].metrics)
    assert metrics["pdserve_kv_parked_handles"] == 0
    assert metrics["pdserve_kv_expiries_total"] == before + 1
    assert decode_error(stack, response.kv_handle).code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("tamper", ["version", "fingerprint", "shape", "dtype", "backend", "bytes"])
def test_incompatible_handle_is_refused_before_any_transfer(stack_pool: StackPool, tamper: str) -> None:
    stack = stack_pool.get(MODEL)
    response = asyncio.run(prefill(stack, [9, 8, 7, 6]))
    handle = kv_pb2.KvHandle()
    handle.CopyFrom(response.kv_handle)
    if tamper == "version":
        handle.version += 1
    elif tamper == "fingerprint":
        handle.model_fingerprint = "0" * 32
    elif tamper == "shape":
        handle.tensors[1].shape[2] += 1
    elif tamper == "dtype":
        handle.tensors[0].dtype = "bfloat16"
    elif tamper == "backend":
        handle.backend = "nccl"
    else:
        handle.num_bytes += 64
    pulls_before = scrape(stack.prefills[0].metrics)["pdserve_kv_pulls_total"]
    error = decode_error(stack, handle)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
    assert scrape(stack.prefills[0].metrics)["pdserve_kv_pulls_total"] == pulls_before
    assert asyncio.run(release(stack, handle.id)), "the refused KV should still be parked"


def test_malformed_pull_is_invalid_argument(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)

    async def pull(request: prefill_pb2.PullKvRequest) -> None:
        async with internal_aio_channel(stack.prefills[0].grpc) as channel:
            await prefill_pb2_grpc.PrefillStub(channel).PullKv(request)

    for request, code in (
        (prefill_pb2.PullKvRequest(handle_id=b"x"), grpc.StatusCode.INVALID_ARGUMENT),
        (prefill_pb2.PullKvRequest(handle_id=secrets.token_bytes(16)), grpc.StatusCode.INVALID_ARGUMENT),
        (
            prefill_pb2.PullKvRequest(
                handle_id=secrets.token_bytes(16),
                decode_instance_id="d",
                pair_generation=1,
                pair_secret=secrets.token_bytes(32),
            ),
            grpc.StatusCode.NOT_FOUND,
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(pull(request))
        assert info.value.code() == code


def test_prefill_rejects_bad_input_directly(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)

    async def call(request: prefill_pb2.PrefillRequest) -> None:
        async with internal_aio_channel(stack.prefills[0].grpc) as channel:
            await prefill_pb2_grpc.PrefillStub(channel).Prefill(request)

    for request, named in (
        (prefill_pb2.PrefillRequest(prompt_token_ids=[], sampling=GREEDY), "prompt"),
        (prefill_pb2.PrefillRequest(prompt_token_ids=[10**7], sampling=GREEDY), "prompt_token_ids[0]"),
        (
            prefill_pb2.PrefillRequest(
                prompt_token_ids=[1], sampling=sampling_pb2.SamplingParams(temperature=1.0)
            ),
            "seed",
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(call(request))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert named in (info.value.details() or "")
