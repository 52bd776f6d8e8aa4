"""Continuous batching in decode: requests join and leave at different steps, stay equal to
greedy `model.generate`, and wait (not fail) when the KV pool is full."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from tests.conftest import PRESETS, StackPool, assert_no_leaks
from tests.grpc_client import generate, make_request
from tests.stack import Stack, internal_aio_channel, scrape, wait_for
from tests.test_equivalence import divergence_report, reference_tokens


async def staggered(address: str, prompts: list[list[int]], max_tokens: list[int], gap_s: float) -> list[Any]:
    async def one(i: int) -> Any:
        await asyncio.sleep(i * gap_s)
        request = make_request(prompt_token_ids=prompts[i], max_tokens=max_tokens[i], temperature=0.0)
        return await generate(address, request)

    return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))


@pytest.mark.parametrize("model_name", PRESETS)
def test_staggered_arrivals_match_generate(
    model_name: str, stack_pool: StackPool, reference_models: Any
) -> None:
    stack = stack_pool.get(model_name)
    model, _ = reference_models(model_name)
    generator = torch.Generator().manual_seed(7)
    lengths = [5, 40, 12, 90, 3, 64, 25, 150, 8, 33]
    max_tokens = [40, 7, 55, 20, 64, 3, 31, 12, 48, 26]
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    before = scrape(stack.decodes[0].metrics)
    results = asyncio.run(staggered(stack.address, prompts, max_tokens, gap_s=0.03))
    after = scrape(stack.decodes[0].metrics)
    for prompt, n, result in zip(prompts, max_tokens, results, strict=True):
        ref = reference_tokens(model, prompt, n)
        assert result.token_ids == ref, divergence_report(model, prompt, ref, result.token_ids)
    tokens = after["pdserve_decode_generated_tokens_total"] - before["pdserve_decode_generated_tokens_total"]
    steps = after["pdserve_decode_steps_total"] - before["pdserve_decode_steps_total"]
    assert tokens > 0 and steps < tokens * 0.6, f"no batching: {tokens} tokens in {steps} steps"


@pytest.fixture(scope="module")
def small_pool_stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    stack = Stack(
        "tiny-llama",
        cache_dir,
        tmp_path_factory.mktemp("small-pool"),
        decode_args=["--max-kv-tokens", "256", "--kv-block-size", "16"],
    ).start()
    yield stack
    stack.stop()


def test_full_pool_makes_requests_wait_not_fail(small_pool_stack: Stack, reference_models: Any) -> None:
    stack = small_pool_stack
    model, _ = reference_models("tiny-llama")
    # Each request reserves ceil((60 + 40 - 1) / 16) = 7 of the 16 blocks: two run at a time.
    prompts = [list(range(10 + i, 70 + i)) for i in range(6)]
    seen_waiting: list[float] = []
    seen_blocks: list[float] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            metrics = scrape(stack.decodes[0].metrics)
            seen_waiting.append(metrics["pdserve_decode_waiting"])
            seen_blocks.append(metrics["pdserve_decode_kv_blocks_used"])
            done.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = asyncio.run(staggered(stack.address, prompts, [40] * 6, gap_s=0.0))
    finally:
        done.set()
        watcher.join()
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_tokens(model, prompt, 40)
    assert max(seen_waiting) >= 1, "no request ever waited for the pool"
    assert max(seen_blocks) <= 16
    assert_no_leaks(stack)
    assert scrape(stack.decodes[0].metrics)["pdserve_decode_kv_blocks_used"] == 0


def test_request_larger_than_the_pool_is_refused(small_pool_stack: Stack) -> None:
    stack = small_pool_stack
    greedy = sampling_pb2.SamplingParams(max_tokens=300, temperature=0.0)

    async def scenario() -> grpc.StatusCode:
        async with internal_aio_channel(stack.prefills[0].grpc) as channel:
            first = await prefill_pb2_grpc.PrefillStub(channel).Prefill(
                prefill_pb2.PrefillRequest(prompt_token_ids=[1, 2, 3], sampling=greedy)
            )
        try:
            async with internal_aio_channel(stack.decodes[0].grpc) as channel:
                call = decode_pb2_grpc.DecodeStub(channel).Decode(
                    decode_pb2.DecodeRequest(
                        kv_handle=first.kv_handle, first_token_id=first.first_token_id, sampling=greedy
                    )
                )
                async for _ in call:
                    pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            async with internal_aio_channel(stack.prefills[0].grpc) as channel:
                await prefill_pb2_grpc.PrefillStub(channel).ReleaseKv(
                    prefill_pb2.ReleaseKvRequest(handle_id=first.kv_handle.id)
                )
        return grpc.StatusCode.OK

    assert asyncio.run(scenario()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert_no_leaks(stack)


@pytest.mark.parametrize("model_name", PRESETS)
def test_concurrent_prompts_are_prefilled_together(
    model_name: str, stack_pool: StackPool, reference_models: Any
) -> None:
    stack = stack_pool.get(model_name)
    model, _ = reference_models(model_name)
    generator = torch.Generator().manual_seed(11)
    lengths = [4, 30, 17, 120, 1, 64, 9, 77, 45, 2, 200, 13]
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    max_tokens = [1, 2, 3] * 4
    before = scrape(stack.prefills[0].metrics)
    assert stack.gateway is not None
    gateway_metrics = stack.gateway.metrics

    async def held_then_released() -> list[Any]:
        # The prefill is frozen while the requests reach it, so they are waiting together.
        stack.prefills[0].signal(signal.SIGSTOP)
        try:
            calls = asyncio.ensure_future(staggered(stack.address, prompts, max_tokens, gap_s=0.0))
            arrived = await asyncio.to_thread(
                wait_for, lambda: scrape(gateway_metrics)["pdserve_gateway_in_flight"] == len(prompts), 30
            )
            assert arrived
            await asyncio.sleep(0.3)
        finally:
            stack.prefills[0].signal(signal.SIGCONT)
        return list(await calls)

    results = asyncio.run(held_then_released())
    after = scrape(stack.prefills[0].metrics)
    for prompt, n, result in zip(prompts, max_tokens, results, strict=True):
        ref = reference_tokens(model, prompt, n)
        assert result.token_ids == ref, divergence_report(model, prompt, ref, result.token_ids)
    requests = after["pdserve_prefill_batch_size_count"] - before["pdserve_prefill_batch_size_count"]
    batch_sizes = after["pdserve_prefill_batch_size_sum"] - before["pdserve_prefill_batch_size_sum"]
    assert requests == len(prompts)
    # Forwards of at most 128 tokens on CPU (rows x longest prompt): the short prompts share them.
    assert batch_sizes / requests > 1.0, (
        f"concurrent prompts were not prefilled together: {batch_sizes / requests}"
    )
