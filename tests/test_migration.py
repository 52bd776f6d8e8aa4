"""Streams survive the loss of their decode exactly: the gateway continues them on another one.

One stack of tiny-llama with 2 prefills and 2 decodes on fixed ports (a killed process comes back on
its address) and a 1 s drain grace on the decodes. Many streams of a few hundred tokens run at once;
once every one has tokens, one decode is killed (SIGKILL), hung (SIGSTOP) or drained (SIGTERM). Every
stream completes, token for token what an undisturbed run gives: greedy `model.generate`, or the same
seeded requests run before on the same stack. Afterwards nothing is left parked or running.
"""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from pdserve.core.sampling import SamplingParams
from pdserve.rpc.sampling_proto import sampling_to_proto
from pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    kv_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    sampling_pb2,
)
from tests.conftest import assert_no_leaks
from tests.grpc_client import Stream, generate_many, make_request
from tests.stack import ServiceProcess, Stack, free_port, internal_aio_channel, scrape, wait_for
from tests.test_equivalence import divergence_report
from tests.test_sampled_stack import one_process

MODEL = "tiny-llama"
NUM_STREAMS = 16
NUM_TOKENS = 300
DRAIN_GRACE_S = 1.0

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(
        MODEL,
        cache_dir,
        tmp_path_factory.mktemp("migration-logs"),
        num_prefill=2,
        num_decode=2,
        decode_args=["--grace-s", str(DRAIN_GRACE_S)],
        ready_timeout_s=300.0,
    )
    for service in (*s.prefills, *s.decodes):
        service.args += ["--port", str(free_port())]
    try:
        yield s.start()
    finally:
        s.stop()


def reference_tokens(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the one-process model, past EOS (the requests ignore it)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return one_process(model, prompt, params, set())


def _prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (4 + 5 * i,), generator=generator).tolist() for i in range(NUM_STREAMS)]


def _gateway(stack: Stack) -> dict[str, float]:
    assert stack.gateway is not None
    return scrape(stack.gateway.metrics)


def _busiest(stack: Stack) -> int:
    running = [scrape(d.metrics)["pdserve_decode_running"] for d in stack.decodes]
    return 0 if running[0] >= running[1] else 1


async def _until(predicate: Any, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "timed out waiting for the streams to have tokens"
        await asyncio.sleep(0.01)


def _disturbed(
    stack: Stack, requests: list[gateway_pb2.GenerateRequest], disturb: Any
) -> tuple[list[Stream], ServiceProcess, float]:
    """Runs ``requests`` as streams; once each has a token from decode, ``disturb(victim)`` the busiest
    decode. Returns the ended streams, the victim and the decode moves the gateway made."""
    before = _gateway(stack)["pdserve_gateway_retries_total{stage=decode}"]

    async def scenario() -> tuple[list[Stream], ServiceProcess]:
        streams = [Stream(stack.address, r, timeout_s=300) for r in requests]
        await _until(lambda: all(len(s.tokens) >= 2 for s in streams))
        victim = stack.decodes[_busiest(stack)]
        disturb(victim)
        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 240)
        return streams, victim

    streams, victim = asyncio.run(scenario())
    moved = _gateway(stack)["pdserve_gateway_retries_total{stage=decode}"] - before
    for s in streams:
        assert s.error is None, s.error
    return streams, victim, moved


def _restart(service: ServiceProcess) -> None:
    assert service.popen is not None
    service.popen.wait(30)
    service.start()
    service.wait_ready()


def _both_serving(stack: Stack) -> None:
    assert wait_for(lambda: _gateway(stack)["pdserve_gateway_backends_serving{role=decode}"] == 2, 30)
    assert wait_for(lambda: _gateway(stack)["pdserve_gateway_backends_serving{role=prefill}"] == 2, 30)


def test_greedy_streams_continue_exactly_when_their_decode_is_killed(
    stack: Stack, reference_models: Any
) -> None:
    model, _ = reference_models(MODEL)
    prompts = _prompts(1)
    requests = [
        make_request(prompt_token_ids=p, max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
        for p in prompts
    ]
    streams, victim, moved = _disturbed(stack, requests, lambda v: v.signal(signal.SIGKILL))
    assert moved >= 1, "no stream was on the killed decode"
    for prompt, s in zip(prompts, streams, strict=True):
        ref = reference_tokens(model, prompt, NUM_TOKENS)
        assert s.tokens == ref, divergence_report(model, prompt, ref, s.tokens)
    migrated = _gateway(stack)["pdserve_gateway_migrated_tokens_total"]
    assert migrated >= 2 * moved, "every moved stream had delivered tokens"
    _restart(victim)
    _both_serving(stack)
    assert_no_leaks(stack)


def test_seeded_streams_continue_exactly_when_their_decode_hangs(stack: Stack) -> None:
    prompts = _prompts(2)
    requests = [
        make_request(
            prompt_token_ids=p,
            max_tokens=NUM_TOKENS,
            temperature=1.0,
            top_k=40 if i % 2 else 0,
            top_p=0.9 if i % 3 else 1.0,
            seed=1000 + i,
            ignore_eos=True,
        )
        for i, p in enumerate(prompts)
    ]
    undisturbed = asyncio.run(generate_many(stack.address, requests))
    streams, victim, moved = _disturbed(stack, requests, lambda v: v.signal(signal.SIGSTOP))
    victim.signal(signal.SIGCONT)
    assert moved >= 1, "no stream was on the hung decode"
    for expected, s in zip(undisturbed, streams, strict=True):
        assert s.tokens == expected.token_ids
    # The hung decode, running again, finds its calls cancelled and frees everything.
    _both_serving(stack)
    assert_no_leaks(stack)


def test_streams_continue_exactly_when_their_decode_drains(stack: Stack, reference_models: Any) -> None:
    """A decode's SIGTERM with a grace period shorter than its streams: those still running when it
    ends (UNAVAILABLE) continue elsewhere."""
    model, _ = reference_models(MODEL)
    prompts = _prompts(3)[:6]
    num_tokens = 3 * NUM_TOKENS
    requests = [
        make_request(prompt_token_ids=p, max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
        for p in prompts
    ]
    streams, victim, moved = _disturbed(stack, requests, lambda v: v.signal(signal.SIGTERM))
    assert moved >= 1, "no stream outlived the drained decode's grace period"
    for prompt, s in zip(prompts, streams, strict=True):
        ref = reference_tokens(model, prompt, num_tokens)
        assert s.tokens == ref, divergence_report(model, prompt, ref, s.tokens)
    assert victim.popen is not None and victim.popen.wait(30) == 0
    _restart(victim)
    _both_serving(stack)
    assert_no_leaks(stack)


def test_a_seeded_stream_continues_when_its_prefill_dies_before_the_pull(stack: Stack) -> None:
    """Both decodes held (SIGSTOP) while the first token streams; the prefill holding the KV dies;
    the pull fails and the gateway prefills the request again elsewhere, its first token kept."""
    request = make_request(
        prompt_token_ids=_prompts(4)[5], max_tokens=40, temperature=0.8, seed=77, ignore_eos=True
    )
    (undisturbed,) = asyncio.run(generate_many(stack.address, [request]))

    async def scenario() -> Stream:
        for d in stack.decodes:
            d.signal(signal.SIGSTOP)
        try:
            stream = Stream(stack.address, request)
            await _until(lambda: len(stream.tokens) >= 1)
            owner = next(p for p in stack.prefills if scrape(p.metrics)["pdserve_kv_parked_handles"] == 1)
            owner.signal(signal.SIGKILL)
        finally:
            for d in stack.decodes:
                d.signal(signal.SIGCONT)
        await asyncio.wait_for(stream.task, 60)
        return stream

    stream = asyncio.run(scenario())
    assert stream.error is None, stream.error
    assert stream.tokens == undisturbed.token_ids
    killed = next(p for p in stack.prefills if p.popen is not None and p.popen.poll() is not None)
    _restart(killed)
    _both_serving(stack)
    assert_no_leaks(stack)


def test_streams_end_unavailable_when_no_decode_is_left(stack: Stack) -> None:
    """Every decode killed mid-stream: the moves are bounded and the stream ends with UNAVAILABLE,
    saying how many tokens reached the client."""
    requests = [
        make_request(prompt_token_ids=p, max_tokens=2 * NUM_TOKENS, temperature=0.0, ignore_eos=True)
        for p in _prompts(5)[:4]
    ]

    async def scenario() -> list[Stream]:
        streams = [Stream(stack.address, r, timeout_s=120) for r in requests]
        await _until(lambda: all(len(s.tokens) >= 2 for s in streams))
        for d in stack.decodes:
            d.signal(signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), 60)
        return streams

    streams = asyncio.run(scenario())
    failed = [s for s in streams if s.error is not None]
    assert failed, "every stream finished before the decodes were killed"
    for s in failed:
        assert s.error is not None
        assert s.error.code() == grpc.StatusCode.UNAVAILABLE
        assert f"{len(s.tokens)} tokens were delivered" in (s.error.details() or ""), s.error.details()
    for d in stack.decodes:
        _restart(d)
    _both_serving(stack)
    assert_no_leaks(stack)


async def _prefill(stack: Stack, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
    async with internal_aio_channel(stack.prefills[0].grpc) as channel:
        response: prefill_pb2.PrefillResponse = await prefill_pb2_grpc.PrefillStub(channel).Prefill(request)
        return response


async def _release(stack: Stack, handle: kv_pb2.KvHandle) -> None:
    async with internal_aio_channel(stack.prefills[0].grpc) as channel:
        await prefill_pb2_grpc.PrefillStub(channel).ReleaseKv(
            prefill_pb2.ReleaseKvRequest(handle_id=handle.id)
        )


def test_a_resumed_prefill_samples_at_its_step_and_counts_the_whole_request(
    stack: Stack, reference_models: Any
) -> None:
    model, _ = reference_models(MODEL)
    prompt = _prompts(6)[3]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)

    def resumed(params: SamplingParams, generated: list[int]) -> prefill_pb2.PrefillResponse:
        request = prefill_pb2.PrefillRequest(
            request_id="resumed",
            prompt_token_ids=prompt + generated,
            sampling=sampling_to_proto(params),
            num_generated=len(generated),
        )
        return asyncio.run(_prefill(stack, request))

    for params in (greedy, seeded):
        ref = one_process(model, prompt, params, set())
        middle = resumed(params, ref[:7])  # sampled at step 7, not 0
        assert (middle.first_token_id, middle.finish_reason) == (ref[7], "")
        assert middle.kv_handle.num_tokens == len(prompt) + 7
        asyncio.run(_release(stack, middle.kv_handle))
        last = resumed(params, ref[:11])  # the 12th token of a 12-token request: complete
        assert (last.first_token_id, last.finish_reason) == (ref[11], "length")
        assert not last.HasField("kv_handle")
    assert_no_leaks(stack)


HOSTILE_PREFILLS = [
    ("no prompt left", [5, 6, 7], 3, "num_generated"),
    ("beyond the prompt", [5, 6, 7], 2**32 - 1, "num_generated"),
    ("request already complete", [5] * 20, 12, "num_generated"),
]


@pytest.mark.parametrize(("case", "ids", "num_generated", "named"), HOSTILE_PREFILLS)
def test_a_bad_num_generated_is_invalid_argument_on_prefill(
    stack: Stack, case: str, ids: list[int], num_generated: int, named: str
) -> None:
    request = prefill_pb2.PrefillRequest(
        request_id="hostile",
        prompt_token_ids=ids,
        sampling=sampling_pb2.SamplingParams(max_tokens=12, temperature=0.0),
        num_generated=num_generated,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(_prefill(stack, request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
    assert named in (info.value.details() or ""), case


@pytest.mark.parametrize("num_generated", [12, 30, 2**32 - 1])
def test_a_bad_num_generated_is_invalid_argument_on_decode(stack: Stack, num_generated: int) -> None:
    """At or past max_tokens (12), or past the KV's positions (30 of 20 + 10): refused before the pull."""
    sampling = sampling_pb2.SamplingParams(max_tokens=12 if num_generated == 12 else 64, temperature=0.0)
    parked = asyncio.run(
        _prefill(
            stack,
            prefill_pb2.PrefillRequest(
                request_id="hostile", prompt_token_ids=[5] * 30, sampling=sampling, num_generated=10
            ),
        )
    )

    async def decode() -> None:
        async with internal_aio_channel(stack.decodes[0].grpc) as channel:
            call = decode_pb2_grpc.DecodeStub(channel).Decode(
                decode_pb2.DecodeRequest(
                    request_id="hostile",
                    kv_handle=parked.kv_handle,
                    first_token_id=parked.first_token_id,
                    sampling=sampling,
                    num_generated=num_generated,
                )
            )
            async for _ in call:
                pass

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(decode())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_generated" in (info.value.details() or "")
    asyncio.run(_release(stack, parked.kv_handle))
    assert_no_leaks(stack)


def test_structured_streams_continue_their_grammar_when_their_decode_is_killed(stack: Stack) -> None:
    """The moved decode rebuilds each stream's grammar from the tokens delivered so far: the output
    still matches, token for token what the undisturbed run gave."""
    pattern = "[a-z ]{200}"
    requests = [
        make_request(
            prompt_token_ids=p,
            max_tokens=NUM_TOKENS,
            temperature=1.0,
            seed=2000 + i,
            structured_output=sampling_pb2.StructuredOutput(regex=pattern),
        )
        for i, p in enumerate(_prompts(5))
    ]
    undisturbed = asyncio.run(generate_many(stack.address, requests))
    assert all(r.finish_reason == "stop" and re.fullmatch(pattern, r.text) for r in undisturbed)
    streams, victim, moved = _disturbed(stack, requests, lambda v: v.signal(signal.SIGKILL))
    assert moved >= 1, "no stream was on the killed decode"
    for expected, s in zip(undisturbed, streams, strict=True):
        assert s.tokens == expected.token_ids
    _restart(victim)
    _both_serving(stack)
    assert_no_leaks(stack)
