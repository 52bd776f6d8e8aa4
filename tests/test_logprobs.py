"""Logprobs through a real stack (tiny-llama, HTTP on), driven by the official `openai` client: every
logprob equals a one-process forward's ``log_softmax`` (float32) to 1e-4, whether it came from the
prefill (the first token, the prompt's) or the decode (the rest); echo, ``prompt_logprobs``, chat's
shape, the gRPC shape, the 400s of bad counts, and sampling unchanged with logprobs on.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch

from pdserve.v1 import decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from tests.grpc_client import make_request, run
from tests.stack import Stack, internal_channel, scrape

MODEL = "tiny-llama"
PROMPT = [5, 17, 99, 230, 41, 7, 64, 12]
TOL = 1e-4


@pytest.fixture(scope="module")
def stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        MODEL, cache_dir, tmp_path_factory.mktemp("logprobs-logs"), gateway_args=["--http-port", "0"]
    )
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def http(stack: Stack) -> str:
    assert stack.gateway is not None
    return str(stack.gateway.ready["http"])


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{http(stack)}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(reference_models: Any) -> tuple[Any, Any]:
    model, tokenizer = reference_models(MODEL)
    return model, tokenizer


def ref_logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]``: position i's log_softmax, predicting token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def post(stack: Stack, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://{http(stack)}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def check_top(top: dict[str, float], row: torch.Tensor, token: str, tokenizer: Any, k: int) -> None:
    """A completion position's top_logprobs: its own token and the k most likely ones, right values."""
    expected = {tokenizer.decode([t]): float(row[t]) for t in torch.topk(row, k).indices.tolist()}
    assert token in top
    assert set(expected) <= set(top) and len(top) <= k + 1
    for text, value in expected.items():
        assert math.isclose(top[text], value, abs_tol=TOL)


def test_completion_logprobs_equal_reference(client: openai.OpenAI, reference: tuple[Any, Any]) -> None:
    model, tokenizer = reference
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    choice = out.choices[0]
    assert choice.logprobs is not None
    ids = list(PROMPT)
    for _ in range(5):  # the greedy continuation, one forward each
        ids.append(int(ref_logprobs(model, ids)[-1].argmax()))
    generated = ids[len(PROMPT) :]
    ref = ref_logprobs(model, ids)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in generated]
    assert lp.token_logprobs is not None and lp.top_logprobs is not None and lp.text_offset is not None
    for i, token_id in enumerate(generated):  # the first from the prefill, the rest from the decode
        row = ref[len(PROMPT) - 1 + i]
        assert math.isclose(lp.token_logprobs[i], float(row[token_id]), abs_tol=TOL)
        check_top(lp.top_logprobs[i], row, lp.tokens[i], tokenizer, 3)
        assert next(iter(lp.top_logprobs[i])) == lp.tokens[i]  # its own token first, as vLLM lists it
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.text_offset == offsets


def test_lm_eval_loglikelihood_request(stack: Stack, reference: tuple[Any, Any]) -> None:
    """The request lm-evaluation-harness's local-completions sends for loglikelihood: complete at
    its first token, it never reaches decode."""
    model, tokenizer = reference
    decode_requests = scrape(stack.decodes[0].metrics)["pdserve_decode_requests_total"]
    status, body = post(
        stack,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": [PROMPT],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        },
    )
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    ref = ref_logprobs(model, PROMPT)
    first = int(ref[-1].argmax())
    assert choice["text"] == tokenizer.decode(PROMPT) + tokenizer.decode([first])
    assert lp["tokens"] == [tokenizer.decode([t]) for t in [*PROMPT, first]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(PROMPT)):  # the prompt's, from the prefill's all-position logits
        row = ref[i - 1]
        assert math.isclose(lp["token_logprobs"][i], float(row[PROMPT[i]]), abs_tol=TOL)
        check_top(lp["top_logprobs"][i], row, lp["tokens"][i], tokenizer, 1)
    assert math.isclose(lp["token_logprobs"][-1], float(ref[-1][first]), abs_tol=TOL)
    prompt_field = choice["prompt_logprobs"]
    assert prompt_field[0] is None and len(prompt_field) == len(PROMPT)
    entry = prompt_field[1][str(PROMPT[1])]
    assert math.isclose(entry["logprob"], float(ref[0][PROMPT[1]]), abs_tol=TOL)
    assert entry["rank"] == int((ref[0] >= ref[0][PROMPT[1]]).sum())
    assert entry["decoded_token"] == tokenizer.decode([PROMPT[1]])
    assert body["usage"]["prompt_tokens"] == len(PROMPT)
    assert scrape(stack.decodes[0].metrics)["pdserve_decode_requests_total"] == decode_requests


def test_echo_with_max_tokens_zero_returns_the_prompt(stack: Stack, reference: tuple[Any, Any]) -> None:
    model, tokenizer = reference
    text = tokenizer.decode(PROMPT[1:])
    status, body = post(
        stack,
        "/v1/completions",
        {"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0},
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == text
    ids = tokenizer(text).input_ids
    ref = ref_logprobs(model, ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert math.isclose(lp["token_logprobs"][i], float(ref[i - 1][ids[i]]), abs_tol=TOL)
        assert len(lp["top_logprobs"][i]) == 1
    status, body = post(stack, "/v1/completions", {"prompt": text, "max_tokens": 0, "echo": True})
    assert status == 200 and body["choices"][0]["text"] == text and body["choices"][0]["logprobs"] is None


def test_prompt_logprobs_through_decode(stack: Stack, reference: tuple[Any, Any]) -> None:
    """prompt_logprobs without echo, on a request that goes on to decode."""
    model, _ = reference
    status, body = post(
        stack,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2, "ignore_eos": True},
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["logprobs"] is None
    ref = ref_logprobs(model, PROMPT)
    field = choice["prompt_logprobs"]
    assert field[0] is None
    for i in range(1, len(PROMPT)):
        row = ref[i - 1]
        top = torch.topk(row, 2).indices.tolist()
        assert set(field[i]) >= {str(t) for t in top} and str(PROMPT[i]) in field[i]
        assert len(field[i]) <= 3
        for key, entry in field[i].items():
            assert math.isclose(entry["logprob"], float(row[int(key)]), abs_tol=TOL)


def test_stream_logprobs_equal_whole(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**fields).choices[0]
    tokens: list[str] = []
    values: list[float | None] = []
    text = ""
    for chunk in client.completions.create(stream=True, **fields):
        if not chunk.choices:
            continue
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens or []
            values += chunk.choices[0].logprobs.token_logprobs or []
    assert whole.logprobs is not None
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    assert values == whole.logprobs.token_logprobs


def test_chat_logprobs_shape(client: openai.OpenAI, reference: tuple[Any, Any]) -> None:
    model, tokenizer = reference
    messages = [{"role": "user", "content": "hello there"}]
    for stream in (False, True):
        if stream:
            content = []
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=4,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                if chunk.choices and chunk.choices[0].logprobs is not None:
                    content += chunk.choices[0].logprobs.content or []
        else:
            out = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=4,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
                extra_body={"ignore_eos": True},
            )
            assert out.choices[0].logprobs is not None
            content = out.choices[0].logprobs.content or []
        prompt = tokenizer(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        ).input_ids
        ids = list(prompt)
        for _ in range(4):
            ids.append(int(ref_logprobs(model, ids)[-1].argmax()))
        ref = ref_logprobs(model, ids)
        assert len(content) == 4
        for i, entry in enumerate(content):
            token_id = ids[len(prompt) + i]
            row = ref[len(prompt) - 1 + i]
            assert entry.token == tokenizer.decode([token_id])
            assert entry.bytes == list(entry.token.encode("utf-8"))
            assert math.isclose(entry.logprob, float(row[token_id]), abs_tol=TOL)
            top = torch.topk(row, 2).indices.tolist()
            assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([t]) for t in top]
            for t, got in zip(top, entry.top_logprobs, strict=True):
                assert math.isclose(got.logprob, float(row[t]), abs_tol=TOL)
                assert got.bytes == list(got.token.encode("utf-8"))
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": -2}, "logprobs"),
        ("/v1/completions", {"logprobs": 10**12}, "logprobs"),
        ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"echo": True, "logprobs": 30}, "logprobs"),
        ("/v1/completions", {"logprobs": -1}, "logprobs"),  # the whole vocabulary, above 20
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -5}, "top_logprobs"),
    ],
)
def test_bad_counts_are_400(stack: Stack, path: str, fields: dict[str, Any], param: str) -> None:
    body: dict[str, Any] = {"max_tokens": 2}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = PROMPT
    status, answer = post(stack, path, {**body, **fields})
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert param in answer["error"]["message"] or "logprobs" in answer["error"]["message"]


def test_grpc_shape_and_hostile_counts(stack: Stack, reference: tuple[Any, Any]) -> None:
    model, _ = reference
    result = run(
        stack.address,
        make_request(
            prompt_token_ids=PROMPT,
            max_tokens=4,
            temperature=0,
            ignore_eos=True,
            logprobs=2,
            prompt_logprobs=1,
        ),
    )
    entries = [e for c in result.chunks for e in c.logprobs]
    assert [e.token_id for e in entries] == result.token_ids
    ref = ref_logprobs(model, PROMPT + result.token_ids)
    for i, entry in enumerate(entries):
        row = ref[len(PROMPT) - 1 + i]
        assert math.isclose(entry.logprob, float(row[entry.token_id]), abs_tol=TOL)
        assert list(entry.top_token_ids) == torch.topk(row, 2).indices.tolist()
        assert entry.rank == 1  # greedy: its own token is the most likely
    prompt_entries = list(result.chunks[0].prompt_logprobs)
    assert [e.token_id for e in prompt_entries] == PROMPT[1:]
    assert all(len(c.prompt_logprobs) == 0 for c in result.chunks[1:])
    for count in ({"logprobs": 21}, {"prompt_logprobs": 10**9}):
        with pytest.raises(grpc.RpcError) as info:
            run(stack.address, make_request(prompt_token_ids=PROMPT, max_tokens=2, **count))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sampling_unchanged_with_logprobs(client: openai.OpenAI) -> None:
    """Greedy tokens, and seeded sampled ones, are the same with logprobs on; seeded runs repeat."""
    fields: dict[str, Any] = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 6,
        "extra_body": {"ignore_eos": True},
    }
    greedy = client.completions.create(temperature=0, **fields).choices[0].text
    assert client.completions.create(temperature=0, logprobs=2, **fields).choices[0].text == greedy
    sampled = client.completions.create(temperature=1.0, seed=7, **fields).choices[0].text
    first = client.completions.create(temperature=1.0, seed=7, logprobs=2, **fields).choices[0]
    again = client.completions.create(temperature=1.0, seed=7, logprobs=2, **fields).choices[0]
    assert first.text == sampled == again.text
    assert first.logprobs is not None and again.logprobs is not None
    assert first.logprobs.token_logprobs == again.logprobs.token_logprobs


def test_chat_prompt_logprobs(stack: Stack, reference: tuple[Any, Any]) -> None:
    model, tokenizer = reference
    messages = [{"role": "user", "content": "hello"}]
    status, body = post(
        stack,
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1},
    )
    assert status == 200, body
    prompt = tokenizer(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    ).input_ids
    ref = ref_logprobs(model, prompt)
    field = body["prompt_logprobs"]
    assert len(field) == len(prompt) and field[0] is None
    for i in range(1, len(prompt)):
        entry = field[i][str(prompt[i])]
        assert math.isclose(entry["logprob"], float(ref[i - 1][prompt[i]]), abs_tol=TOL)
    assert body["choices"][0]["logprobs"] is None


def test_internal_services_refuse_hostile_counts(stack: Stack) -> None:
    huge = sampling_pb2.SamplingParams(max_tokens=2, temperature=0, logprobs=2**32 - 1)
    with internal_channel(stack.prefills[0].grpc) as channel:
        prefill = prefill_pb2_grpc.PrefillStub(channel)
        for sampling in (
            huge,
            sampling_pb2.SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=10**6),
        ):
            with pytest.raises(grpc.RpcError) as info:
                prefill.Prefill(
                    prefill_pb2.PrefillRequest(prompt_token_ids=PROMPT, sampling=sampling), timeout=30
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "logprobs" in (info.value.details() or "")
    with internal_channel(stack.decodes[0].grpc) as channel:
        decode = decode_pb2_grpc.DecodeStub(channel)
        request = decode_pb2.DecodeRequest(
            kv_handle=kv_pb2.KvHandle(num_tokens=4), first_token_id=1, sampling=huge
        )
        with pytest.raises(grpc.RpcError) as info:
            list(decode.Decode(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.logprobs" in (info.value.details() or "")
