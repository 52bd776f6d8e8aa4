"""The first token: sampled by the prefill forward, streamed before decode, and the end of requests
complete at it (max_tokens=1, EOS, stop) without any decode call or KV movement."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import grpc
import torch

from pdserve.v1 import gateway_pb2_grpc
from tests.conftest import EOS_PROMPT, StackPool, assert_no_leaks, first_greedy_token
from tests.grpc_client import make_request, run
from tests.stack import Stack, scrape, wait_for

MODEL = "tiny-llama"


def counters(stack: Stack) -> dict[str, float]:
    prefill = scrape(stack.prefills[0].metrics)
    decode = scrape(stack.decodes[0].metrics)
    assert stack.gateway is not None
    gateway = scrape(stack.gateway.metrics)
    return {
        "parks": prefill["pdserve_kv_parks_total"],
        "pulls": prefill["pdserve_kv_pulls_total"],
        "sent_bytes": prefill["pdserve_kv_sent_bytes_total"],
        "decode_requests": decode["pdserve_decode_requests_total"],
        "received_bytes": decode["pdserve_kv_received_bytes_total"],
        "decode_calls": gateway["pdserve_gateway_decode_calls_total"],
    }


PROMPT = EOS_PROMPT


def test_max_tokens_one_never_reaches_decode(stack_pool: StackPool, reference_models: Any) -> None:
    stack = stack_pool.get(MODEL)
    model, _ = reference_models(MODEL)
    before = counters(stack)
    for prompt in (PROMPT, PROMPT[:1], list(range(40, 140))):
        result = run(stack.address, make_request(prompt_token_ids=prompt, max_tokens=1, temperature=0.0))
        assert result.token_ids == [first_greedy_token(model, prompt)]
        assert result.finish_reason == "length"
        assert len(result.chunks) == 1
    assert counters(stack) == before, "a max_tokens=1 request parked or moved KV, or called decode"


def test_stop_token_and_stop_string_at_first_token(stack_pool: StackPool, reference_models: Any) -> None:
    stack = stack_pool.get(MODEL)
    model, tokenizer = reference_models(MODEL)
    first = first_greedy_token(model, PROMPT)
    before = counters(stack)
    result = run(
        stack.address,
        make_request(prompt_token_ids=PROMPT, max_tokens=20, temperature=0.0, stop_token_ids=[first]),
    )
    assert result.token_ids == [first]
    assert result.finish_reason == "stop"

    # A stop string inside the first token's text: the request ends there, the stop string unsent.
    prompt = next(
        p
        for p in ([i, i + 1, i + 2] for i in range(3, 400, 7))
        if tokenizer.decode([first_greedy_token(model, p)]).strip() not in ("", "\ufffd")
        and "\ufffd" not in tokenizer.decode([first_greedy_token(model, p)])
    )
    token = first_greedy_token(model, prompt)
    text = tokenizer.decode([token])
    result = run(
        stack.address,
        make_request(prompt_token_ids=prompt, max_tokens=20, temperature=0.0, stop=[text.strip()]),
    )
    assert result.token_ids == [token]
    assert result.finish_reason == "stop"
    assert text.strip() not in result.text
    assert counters(stack) == before, "a request complete at its first token reached decode or parked KV"


def test_first_token_streams_while_decode_is_frozen(stack_pool: StackPool, reference_models: Any) -> None:
    """With the decode process stopped (SIGSTOP) the client still gets the first token."""
    stack = stack_pool.get(MODEL)
    model, _ = reference_models(MODEL)
    decode = stack.decodes[0]

    async def scenario() -> tuple[list[int], list[int]]:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                make_request(prompt_token_ids=PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True),
                timeout=60,
            )
            decode.signal(signal.SIGSTOP)
            try:
                first = await asyncio.wait_for(call.read(), timeout=20)
            finally:
                decode.signal(signal.SIGCONT)
            rest: list[int] = []
            while (chunk := await call.read()) is not grpc.aio.EOF:
                rest.extend(chunk.token_ids)
            return list(first.token_ids), rest

    first, rest = asyncio.run(scenario())
    expected = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(PROMPT) :].tolist()
    assert first == expected[:1]
    assert first + rest == expected


def test_cancel_before_pull_releases_kv(stack_pool: StackPool) -> None:
    """The client cancels while decode cannot pull yet: the gateway frees the KV on the prefill."""
    stack = stack_pool.get(MODEL)
    decode = stack.decodes[0]
    before = counters(stack)
    prefill_before = scrape(stack.prefills[0].metrics)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            decode.signal(signal.SIGSTOP)
            try:
                call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                    make_request(prompt_token_ids=PROMPT, max_tokens=30, temperature=0.0, ignore_eos=True)
                )
                await asyncio.wait_for(call.read(), timeout=20)
                assert scrape(stack.prefills[0].metrics)["pdserve_kv_parked_handles"] == 1
                call.cancel()
                released = await asyncio.to_thread(
                    wait_for, lambda: scrape(stack.prefills[0].metrics)["pdserve_kv_parked_handles"] == 0
                )
                assert released, "the KV stayed parked after the client cancelled"
            finally:
                decode.signal(signal.SIGCONT)

    asyncio.run(scenario())
    after = scrape(stack.prefills[0].metrics)
    assert after["pdserve_kv_releases_total"] == prefill_before["pdserve_kv_releases_total"] + 1
    assert counters(stack)["pulls"] == before["pulls"]


def test_cancel_mid_stream_stops_decode(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(stack.address) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                make_request(prompt_token_ids=PROMPT, max_tokens=2000, temperature=0.0, ignore_eos=True)
            )
            for _ in range(4):
                await call.read()
            call.cancel()

    asyncio.run(scenario())
    decode_metrics = stack.decodes[0].metrics
    assert wait_for(lambda: scrape(decode_metrics)["pdserve_decode_running"] == 0, 10)
    generated = scrape(decode_metrics)["pdserve_decode_generated_tokens_total"]
    assert wait_for(lambda: scrape(decode_metrics)["pdserve_decode_generated_tokens_total"] == generated, 1)
    assert_no_leaks(stack)


def test_first_token_eos_never_reaches_decode(eos_stack: Any) -> None:
    stack, eos = eos_stack
    before = counters(stack)
    result = run(stack.address, make_request(prompt_token_ids=PROMPT, max_tokens=16, temperature=0.0))
    assert result.token_ids == [eos]
    assert result.finish_reason == "eos"
    assert counters(stack) == before
    # ignore_eos: the same request goes on through decode.
    result = run(
        stack.address,
        make_request(prompt_token_ids=PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True),
    )
    assert len(result.token_ids) == 5 and result.finish_reason == "length"
    after = counters(stack)
    assert after["decode_calls"] == before["decode_calls"] + 1
    assert after["pulls"] == before["pulls"] + 1
    assert after["received_bytes"] > before["received_bytes"]
    assert_no_leaks(stack)
