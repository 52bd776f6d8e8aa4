"""``n`` > 1 through the real stack, by the official `openai` client and the gRPC API: one prefill
forward, every choice decoded from the prompt's one parked KV.

One prefill and two decodes of tiny-llama: one decode takes the KV in place (shm), the other over a
gloo pair, and the gateway spreads a request's choices over both. Greedy choices equal
``model.generate``; seeded choices equal the shared sampler run in one process with the choice's
seed (``seed + i``), the same on every run and not all alike; streams carry each choice's index;
``max_tokens=1`` never reaches a decode nor parks a KV; a client that leaves cancels every choice;
the choices on a decode that is killed move to the other one, each on its own, token for token.
Each test ends with no KV parked or lent and nothing running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from pdserve.core.sampling import MAX_CHOICES, SamplingParams
from pdserve.v1 import decode_pb2, decode_pb2_grpc, gateway_pb2_grpc, prefill_pb2, sampling_pb2
from tests.conftest import assert_no_leaks
from tests.grpc_client import Result, generate, make_request
from tests.stack import Stack, free_port, internal_aio_channel, scrape, wait_for
from tests.test_equivalence import reference_tokens
from tests.test_migration import _busiest, _prefill, _release, _restart
from tests.test_sampled_stack import one_process

MODEL = "tiny-llama"
MAX_N = 6
PROMPT = [5, 17, 99, 230, 41, 7, 64, 3]


@pytest.fixture(scope="module")
def n_stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        MODEL,
        cache_dir,
        tmp_path_factory.mktemp("n-logs"),
        num_decode=2,
        gateway_args=["--http-port", "0", "--served-model-name", MODEL, "--max-n", str(MAX_N)],
    )
    stack.decodes[1].args.extend(["--kv-backend", "gloo"])
    for decode in stack.decodes:  # a killed decode comes back on its address
        decode.args.extend(["--port", str(free_port())])
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(autouse=True)
def leak_check_n(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "n_stack" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("n_stack"))


def client(stack: Stack) -> openai.OpenAI:
    assert stack.gateway is not None
    return openai.OpenAI(base_url=f"http://{stack.gateway.ready['http']}/v1", api_key="unused", max_retries=0)


def grpc_choices(stack: Stack, **fields: Any) -> dict[int, Result]:
    result = asyncio.run(generate(stack.address, make_request(prompt_token_ids=PROMPT, **fields)))
    by_index: dict[int, Result] = defaultdict(Result)
    for chunk in result.chunks:
        by_index[chunk.index].chunks.append(chunk)
    return dict(by_index)


def counters(stack: Stack) -> dict[str, float]:
    prefill = scrape(stack.prefills[0].metrics)
    decodes = [scrape(d.metrics) for d in stack.decodes]
    return {
        "prefill_requests": prefill["pdserve_prefill_requests_total"],
        "prefill_forwards": prefill["pdserve_prefill_forward_seconds_count"],
        "kv_parks": prefill["pdserve_kv_parks_total"],
        "decode_requests": sum(d["pdserve_decode_requests_total"] for d in decodes),
        "shm_pulls": prefill.get("pdserve_kv_transport_pulls_total{transport=shm}", 0.0),
        "gloo_pulls": prefill.get("pdserve_kv_transport_pulls_total{transport=gloo}", 0.0),
    }


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def test_greedy_choices_equal_generate_with_one_forward(n_stack: Stack, reference_models: Any) -> None:
    model, _ = reference_models(MODEL)
    expected = reference_tokens(model, PROMPT, 8)
    before = counters(n_stack)
    choices = grpc_choices(n_stack, max_tokens=8, temperature=0.0, n=3)
    moved = delta(before, counters(n_stack))
    assert moved["shm_pulls"] and moved["gloo_pulls"]  # the choices went to both decodes
    assert moved == {
        "prefill_requests": 1,
        "prefill_forwards": 1,  # the prompt ran forward once
        "kv_parks": 3,  # one KV, a handle per choice
        "decode_requests": 3,
        "shm_pulls": moved["shm_pulls"],
        "gloo_pulls": 3 - moved["shm_pulls"],
    }
    assert sorted(choices) == [0, 1, 2]
    assert all(c.token_ids == expected for c in choices.values())
    assert all(
        c.chunks[0].request_id and c.chunks[0].num_prompt_tokens == len(PROMPT) for c in choices.values()
    )
    single = grpc_choices(n_stack, max_tokens=8, temperature=0.0)[0]
    assert single.token_ids == expected

    http = client(n_stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in http.choices] == [0, 1, 2]
    assert all(c.text == single.text for c in http.choices)
    assert http.usage is not None
    assert (http.usage.prompt_tokens, http.usage.completion_tokens) == (len(PROMPT), 3 * len(expected))

    messages: Any = [{"role": "user", "content": "hi there"}]
    one = client(n_stack).chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    chat = client(n_stack).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, n=3
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert {c.message.content for c in chat.choices} == {one.choices[0].message.content}
    assert chat.usage is not None and one.usage is not None
    assert chat.usage.prompt_tokens == one.usage.prompt_tokens
    assert chat.usage.completion_tokens == 3 * one.usage.completion_tokens


SEEDED = {"max_tokens": 10, "temperature": 1.0, "seed": 1234, "ignore_eos": True}


def test_seeded_choices_are_reproducible_distinct_and_match_one_process(
    n_stack: Stack, reference_models: Any
) -> None:
    model, _ = reference_models(MODEL)
    first = grpc_choices(n_stack, n=4, **SEEDED)
    again = grpc_choices(n_stack, n=4, **SEEDED)
    assert sorted(first) == [0, 1, 2, 3]
    assert {i: c.token_ids for i, c in first.items()} == {i: c.token_ids for i, c in again.items()}
    assert len({tuple(c.token_ids) for c in first.values()}) > 1
    params = SamplingParams(**SEEDED)
    for index, choice in first.items():
        reference = one_process(model, PROMPT, dataclasses.replace(params, seed=1234 + index), set())
        assert choice.token_ids == reference, f"choice {index}"
    assert (
        grpc_choices(n_stack, **SEEDED)[0].token_ids == first[0].token_ids
    )  # choice 0 is the single request

    extra = {"ignore_eos": True}
    http = client(n_stack).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=1234, n=4, extra_body=extra
    )
    assert [c.text for c in http.choices] == [first[i].text for i in range(4)]
    stream = client(n_stack).completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=1.0,
        seed=1234,
        n=4,
        extra_body=extra,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = defaultdict(str)
    finished: dict[int, str | None] = {}
    usage = None
    for event in stream:
        if event.usage is not None:
            usage = event.usage
        for c in event.choices:
            assert len(event.choices) == 1
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
    assert dict(texts) == {i: first[i].text for i in range(4)}
    assert finished == dict.fromkeys(range(4), "length")
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 40)


def test_streamed_chat_choices_carry_their_index(n_stack: Stack) -> None:
    kwargs: Any = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me"}],
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
        "n": 3,
    }
    whole = client(n_stack).chat.completions.create(**kwargs)
    roles: dict[int, int] = defaultdict(int)
    content: dict[int, str] = defaultdict(str)
    reasons: dict[int, str | None] = {}
    for event in client(n_stack).chat.completions.create(**kwargs, stream=True):
        (c,) = event.choices
        if c.delta.role is not None:
            assert c.index not in content  # a choice's role comes before its content
            roles[c.index] += 1
        content[c.index] += c.delta.content or ""
        if c.finish_reason is not None:
            reasons[c.index] = c.finish_reason
    assert dict(roles) == dict.fromkeys(range(3), 1)
    assert dict(content) == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}


def test_choices_complete_at_their_first_token_take_no_decode_and_no_kv(n_stack: Stack) -> None:
    before = counters(n_stack)
    choices = grpc_choices(n_stack, n=5, max_tokens=1, temperature=1.0, seed=3)
    http = client(n_stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, n=5, seed=3)
    assert delta(before, counters(n_stack)) == {
        "prefill_requests": 2,
        "prefill_forwards": 2,
        "kv_parks": 0,
        "decode_requests": 0,
        "shm_pulls": 0,
        "gloo_pulls": 0,
    }
    assert sorted(choices) == list(range(5))
    assert all(len(c.token_ids) == 1 and c.finish_reason == "length" for c in choices.values())
    assert [c.text for c in http.choices] == [choices[i].text for i in range(5)]
    assert http.usage is not None and http.usage.completion_tokens == 5


def test_client_leaving_cancels_every_choice(n_stack: Stack) -> None:
    stream = client(n_stack).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1500, n=4, seed=5, stream=True, extra_body={"ignore_eos": True}
    )
    seen = set()
    for event in stream:
        seen.update(c.index for c in event.choices)
        if len(seen) == 4:
            break
    stream.close()  # the leak check: nothing left running or parked


@pytest.mark.parametrize("n", [0, -1, MAX_N + 1, 10**12])
def test_hostile_n_is_refused(n_stack: Stack, n: int) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client(n_stack).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=n)
    assert refused.value.param == "n"
    with pytest.raises(openai.BadRequestError):
        client(n_stack).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, n=n
        )
    if 0 <= n < 2**32:  # what a uint32 field can carry
        with pytest.raises(grpc.RpcError) as failed:
            grpc_choices(n_stack, max_tokens=2, n=n)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "n must be in" in (failed.value.details() or "")


def test_each_choice_moves_on_its_own_when_its_decode_is_killed(n_stack: Stack) -> None:
    fields = {"max_tokens": 400, "temperature": 1.0, "seed": 99, "ignore_eos": True, "n": 4}
    undisturbed = grpc_choices(n_stack, **fields)
    assert n_stack.gateway is not None
    retries = "pdserve_gateway_retries_total{stage=decode}"
    before = scrape(n_stack.gateway.metrics)[retries]
    tokens: dict[int, list[int]] = defaultdict(list)

    async def scenario() -> int:
        async with grpc.aio.insecure_channel(n_stack.address) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                make_request(prompt_token_ids=PROMPT, **fields), timeout=300
            )
            victim = -1
            async for chunk in call:
                tokens[chunk.index].extend(chunk.token_ids)
                if victim < 0 and len(tokens) == 4 and all(len(t) >= 2 for t in tokens.values()):
                    victim = _busiest(n_stack)
                    n_stack.decodes[victim].signal(signal.SIGKILL)
            return victim

    victim = asyncio.run(scenario())
    assert victim >= 0
    assert scrape(n_stack.gateway.metrics)[retries] - before >= 1, "no choice was on the killed decode"
    assert dict(tokens) == {i: c.token_ids for i, c in undisturbed.items()}
    _restart(n_stack.decodes[victim])
    _both_serving_decodes(n_stack)


def _both_serving_decodes(stack: Stack) -> None:
    assert stack.gateway is not None
    serving = "pdserve_gateway_backends_serving{role=decode}"
    assert wait_for(lambda: scrape(stack.gateway.metrics)[serving] == 2, 30)  # type: ignore[union-attr]


def test_internal_calls_bound_n(n_stack: Stack) -> None:
    """The prefill takes at most MAX_CHOICES choices; its choices' handles are each a handle (a
    decode refuses a request of several choices, and each releases on its own)."""
    sampling = sampling_pb2.SamplingParams(max_tokens=4, temperature=1.0, seed=1, n=MAX_CHOICES + 1)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(_prefill(n_stack, prefill_pb2.PrefillRequest(prompt_token_ids=PROMPT, sampling=sampling)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.n" in (refused.value.details() or "")

    sampling.n = 2
    answer = asyncio.run(
        _prefill(n_stack, prefill_pb2.PrefillRequest(prompt_token_ids=PROMPT, sampling=sampling))
    )
    assert not answer.HasField("kv_handle") and len(answer.choices) == 2
    handles = [c.kv_handle for c in answer.choices]
    assert handles[0].id != handles[1].id and handles[0].num_bytes == handles[1].num_bytes
    parked = scrape(n_stack.prefills[0].metrics)
    assert (
        parked["pdserve_kv_parked_handles"] == 2 and parked["pdserve_kv_parked_bytes"] == handles[0].num_bytes
    )

    async def decode() -> None:
        async with internal_aio_channel(n_stack.decodes[0].grpc) as channel:
            request = decode_pb2.DecodeRequest(
                request_id="two",
                kv_handle=handles[0],
                first_token_id=answer.choices[0].first_token_id,
                sampling=sampling,
            )
            async for _ in decode_pb2_grpc.DecodeStub(channel).Decode(request):
                pass

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(decode())
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.n must be 1" in (refused.value.details() or "")
    asyncio.run(_release(n_stack, handles[0]))
    assert scrape(n_stack.prefills[0].metrics)["pdserve_kv_parked_bytes"] == handles[0].num_bytes
    asyncio.run(_release(n_stack, handles[1]))  # the last one frees the KV (the leak check)
