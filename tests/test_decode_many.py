"""DecodeMany: many requests over one call, one message per decode step, cancels and per-request errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import torch

from pdserve.v1 import decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from tests.conftest import StackPool, assert_no_leaks
from tests.grpc_client import generate_many, make_request
from tests.stack import Stack, internal_aio_channel, scrape
from tests.test_equivalence import divergence_report, reference_tokens

MODEL = "tiny-llama"


def greedy(max_tokens: int) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def prefill(stack: Stack, prompt: list[int], max_tokens: int) -> decode_pb2.DecodeRequest:
    async with internal_aio_channel(stack.prefills[0].grpc) as channel:
        first = await prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_pb2.PrefillRequest(prompt_token_ids=prompt, sampling=greedy(max_tokens))
        )
    return decode_pb2.DecodeRequest(
        request_id=f"r{len(prompt)}",
        kv_handle=first.kv_handle,
        first_token_id=first.first_token_id,
        sampling=greedy(max_tokens),
    )


class Caller:
    """The caller's side of one DecodeMany call: send starts and cancels, read updates by tag."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.outgoing: asyncio.Queue[decode_pb2.DecodeManyRequest | None] = asyncio.Queue()
        self.call = decode_pb2_grpc.DecodeStub(channel).DecodeMany(self._requests())
        self.updates: dict[int, list[decode_pb2.DecodeUpdate]] = {}
        self.messages = 0

    async def _requests(self) -> AsyncIterator[decode_pb2.DecodeManyRequest]:
        while (message := await self.outgoing.get()) is not None:
            yield message

    def start(self, tag: int, request: decode_pb2.DecodeRequest) -> None:
        self.outgoing.put_nowait(decode_pb2.DecodeManyRequest(tag=tag, start=request))

    def cancel(self, tag: int) -> None:
        self.outgoing.put_nowait(decode_pb2.DecodeManyRequest(tag=tag, cancel=True))

    def close(self) -> None:
        self.outgoing.put_nowait(None)

    async def read_until(self, done: Any) -> None:
        """Reads responses until ``done(self)`` holds."""
        while not done(self):
            response = await self.call.read()
            assert response is not grpc.aio.EOF, "the call ended early"
            self.messages += 1
            for update in response.updates:
                self.updates.setdefault(update.tag, []).append(update)

    def tokens(self, tag: int) -> list[int]:
        return [t for u in self.updates.get(tag, []) for t in u.token_ids]

    def ended(self, tag: int) -> bool:
        return any(u.finish_reason or u.error_code for u in self.updates.get(tag, []))


def test_requests_over_one_call_match_generate_in_few_messages(
    stack_pool: StackPool, reference_models: Any
) -> None:
    stack = stack_pool.get(MODEL)
    model, _ = reference_models(MODEL)
    generator = torch.Generator().manual_seed(11)
    lengths, max_tokens = [5, 31, 12, 47, 9, 20], [24, 30, 2, 16, 28, 21]
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    before = scrape(stack.decodes[0].metrics)

    async def scenario() -> tuple[Caller, list[int]]:
        requests = [await prefill(stack, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
        async with internal_aio_channel(stack.decodes[0].grpc) as channel:
            caller = Caller(channel)
            for tag, request in enumerate(requests, start=1):
                caller.start(tag, request)
            caller.close()
            await caller.read_until(lambda c: all(c.ended(t) for t in range(1, len(requests) + 1)))
            assert await caller.call.read() is grpc.aio.EOF  # half-closed and nothing live: the call ends
            assert await caller.call.code() == grpc.StatusCode.OK
        return caller, [r.first_token_id for r in requests]

    caller, firsts = asyncio.run(scenario())
    for tag, (prompt, n, first) in enumerate(zip(prompts, max_tokens, firsts, strict=True), start=1):
        ref = reference_tokens(model, prompt, n)
        got = [first, *caller.tokens(tag)]
        assert got == ref, divergence_report(model, prompt, ref, got)
        assert caller.updates[tag][-1].finish_reason == "length"
    decoded = sum(n - 1 for n in max_tokens)
    # Six requests step together: far fewer messages than tokens.
    assert caller.messages <= decoded / 3, f"{caller.messages} messages for {decoded} tokens"
    after = scrape(stack.decodes[0].metrics)
    sent = after["pdserve_decode_update_messages_total"] - before["pdserve_decode_update_messages_total"]
    assert sent == caller.messages
    assert_no_leaks(stack)


def test_cancel_bad_requests_and_reused_tags_affect_only_their_request(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)

    async def scenario() -> Caller:
        long, short = await prefill(stack, [5, 6, 7, 8], 200), await prefill(stack, [9, 10, 11], 12)
        missing_handle = decode_pb2.DecodeRequest(
            request_id="no-handle", first_token_id=3, sampling=greedy(4)
        )
        handle = kv_pb2.KvHandle()
        handle.CopyFrom(short.kv_handle)
        handle.id = bytes(16)  # no such KV on that prefill
        unknown = decode_pb2.DecodeRequest(
            request_id="unknown", kv_handle=handle, first_token_id=3, sampling=greedy(4)
        )
        async with internal_aio_channel(stack.decodes[0].grpc) as channel:
            caller = Caller(channel)
            caller.start(1, long)
            caller.start(2, missing_handle)
            caller.start(3, unknown)
            await caller.read_until(lambda c: len(c.tokens(1)) >= 3 and c.ended(2) and c.ended(3))
            caller.start(1, short)  # tag 1 is live: refused, the running request goes on
            caller.start(4, short)
            await caller.read_until(lambda c: c.ended(4) and any(u.error_code for u in c.updates[1]))
            caller.cancel(1)
            caller.close()
            while await caller.call.read() is not grpc.aio.EOF:
                pass
            assert await caller.call.code() == grpc.StatusCode.OK
        return caller

    caller = asyncio.run(scenario())
    assert caller.updates[2][-1].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "kv_handle is required" in caller.updates[2][-1].error_message
    assert caller.updates[3][-1].error_code == grpc.StatusCode.NOT_FOUND.value[0]
    refused = [u for u in caller.updates[1] if u.error_code]
    assert len(refused) == 1 and "tag 1 is already in use" in refused[0].error_message
    assert not any(u.finish_reason for u in caller.updates[1]), "the cancelled request finished"
    assert len(caller.tokens(1)) < 199
    assert caller.updates[4][-1].finish_reason == "length" and len(caller.tokens(4)) == 11
    assert_no_leaks(stack)


def test_cancelling_the_call_cancels_its_requests(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)

    async def scenario() -> None:
        requests = [await prefill(stack, [4 + i, 5, 6], 400) for i in range(3)]
        async with internal_aio_channel(stack.decodes[0].grpc) as channel:
            caller = Caller(channel)
            for tag, request in enumerate(requests, start=1):
                caller.start(tag, request)
            await caller.read_until(lambda c: all(len(c.tokens(t)) >= 2 for t in (1, 2, 3)))
            assert scrape(stack.decodes[0].metrics)["pdserve_decode_running"] == 3
            caller.call.cancel()

    asyncio.run(scenario())
    assert_no_leaks(stack)  # the running set empties: nothing decodes for a caller that left


def test_gateway_requests_share_one_call_per_decode(stack_pool: StackPool, reference_models: Any) -> None:
    stack = stack_pool.get(MODEL)
    model, _ = reference_models(MODEL)
    prompts = [[7 + i, 8, 9, 10 + i] for i in range(8)]
    before = scrape(stack.decodes[0].metrics)
    results = asyncio.run(
        generate_many(
            stack.address,
            [
                make_request(prompt_token_ids=p, max_tokens=30, temperature=0.0, ignore_eos=True)
                for p in prompts
            ],
        )
    )
    after = scrape(stack.decodes[0].metrics)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.token_ids == reference_tokens(model, prompt, 30)
    messages = after["pdserve_decode_update_messages_total"] - before["pdserve_decode_update_messages_total"]
    assert 0 < messages <= 8 * 29 / 3, f"{messages} update messages for {8 * 29} tokens"
    steps = after["pdserve_decode_step_seconds_sum"] - before["pdserve_decode_step_seconds_sum"]
    row_steps = (
        after["pdserve_decode_row_step_seconds_total"] - before["pdserve_decode_row_step_seconds_total"]
    )
    assert steps > 0 and row_steps > 1.5 * steps, "steps of several rows weigh more per row"
    assert_no_leaks(stack)
