"""The gateway's OpenAI-compatible HTTP API, driven by the official `openai` client against real
processes on 127.0.0.1: same tokens as the gRPC API, OpenAI's shapes and errors, the API key,
cancellation on disconnect, `/metrics` with the request-level metrics, and `pdserve up` serving it
by default.

The stack serves a copy of tiny-llama whose EOS is the greedy first token of EOS_PROMPT, so that the
"eos" finish and `ignore_eos` can be seen; prompts that must run to max_tokens set ignore_eos.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import EOS_PROMPT, assert_no_leaks, eos_model_copy
from tests.grpc_client import make_request, run
from tests.stack import ServiceProcess, Stack, scrape, service_env, wait_for
from tests.test_up import pdserve_up

MODEL_ID = "tiny-llama-eos"
LONG = 1900  # tokens: a request that is still decoding when its client leaves


class HttpStack:
    def __init__(self, stack: Stack, model_dir: Path, eos: int) -> None:
        self.stack = stack
        self.model_dir = model_dir
        self.eos = eos
        assert stack.gateway is not None
        self.http = str(stack.gateway.ready["http"])
        self.client = openai.OpenAI(base_url=f"http://{self.http}/v1", api_key="unused", max_retries=0)

    def grpc(self, **fields: Any) -> Any:
        return run(self.stack.address, make_request(**fields))


@pytest.fixture(scope="module")
def http_stack(
    cache_dir: Path, reference_models: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HttpStack]:
    model_dir, eos = eos_model_copy(cache_dir, reference_models, tmp_path_factory.mktemp("http-model"))
    stack = Stack(
        str(model_dir),
        cache_dir,
        tmp_path_factory.mktemp("http-logs"),
        gateway_args=["--http-port", "0", "--served-model-name", MODEL_ID],
    ).start()
    try:
        yield HttpStack(stack, model_dir, eos)
    finally:
        stack.stop()


@pytest.fixture(autouse=True)
def leak_check_http(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "http_stack" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("http_stack").stack)


def http_get(address: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def http_post(address: str, path: str, body: bytes, key: str = "") -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(f"http://{address}{path}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


# --- models and health ---------------------------------------------------------------------------


def test_models_and_health(http_stack: HttpStack) -> None:
    models = http_stack.client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert models.data[0].owned_by == "pdserve"
    assert http_stack.client.models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(openai.NotFoundError):
        http_stack.client.models.retrieve("other-model")
    assert http_get(http_stack.http, "/health") == (200, b"")


# --- completions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["The capital of France is", "héllo wörld, 世界 🙂"])
def test_completion_equals_grpc(http_stack: HttpStack, prompt: str) -> None:
    expected = http_stack.grpc(prompt=prompt, max_tokens=20, temperature=0.0, ignore_eos=True)
    result = http_stack.client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.object == "text_completion" and result.model == MODEL_ID
    assert result.id.startswith("cmpl-")
    assert len(result.choices) == 1
    assert result.choices[0].text == expected.text
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert result.usage.prompt_tokens == expected.chunks[0].num_prompt_tokens
    assert result.usage.completion_tokens == len(expected.token_ids) == 20
    assert result.usage.total_tokens == result.usage.prompt_tokens + 20


def test_completion_stream_with_usage_equals_grpc(http_stack: HttpStack) -> None:
    expected = http_stack.grpc(prompt="Once upon a time", max_tokens=24, temperature=0.0, ignore_eos=True)
    chunks = list(
        http_stack.client.completions.create(
            model=MODEL_ID,
            prompt="Once upon a time",
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *content, last = chunks
    assert len(content) > 1
    assert "".join(c.choices[0].text for c in content) == expected.text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert all(c.usage is None for c in content)
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        expected.chunks[0].num_prompt_tokens,
        24,
    )
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_without_include_usage_has_no_usage_chunk(http_stack: HttpStack) -> None:
    chunks = list(
        http_stack.client.completions.create(
            model=MODEL_ID, prompt="Hello", max_tokens=5, temperature=0, stream=True
        )
    )
    assert all(len(c.choices) == 1 and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_every_token_is_a_chunk_even_when_its_text_is_held_back(http_stack: HttpStack, chat: bool) -> None:
    """As vLLM streams: a token whose text waits (here for a stop string the output might begin) is
    still a chunk, with empty text, so the first token reaches the client when it is sampled."""
    fields: dict[str, Any] = {"model": MODEL_ID, "max_tokens": 6, "temperature": 0}
    fields["extra_body"] = {"ignore_eos": True}
    messages = [{"role": "user", "content": "x"}]
    if chat:
        whole = http_stack.client.chat.completions.create(messages=messages, **fields)
        text = whole.choices[0].message.content or ""
    else:
        text = http_stack.client.completions.create(prompt="Once upon", **fields).choices[0].text
    fields["extra_body"]["stop"] = [text + "\x00never"]  # every prefix of the output may begin it
    if chat:
        chunks = list(http_stack.client.chat.completions.create(messages=messages, stream=True, **fields))
        assert chunks[0].choices[0].delta.role == "assistant"
        texts = [c.choices[0].delta.content or "" for c in chunks[1:] if c.choices[0].finish_reason is None]
    else:
        chunks = list(http_stack.client.completions.create(prompt="Once upon", stream=True, **fields))
        texts = [c.choices[0].text for c in chunks]
    assert len(texts) == 6  # one chunk per token
    assert texts[:5] == [""] * 5 and texts[5] == text  # the text waits for the output's end


def test_completion_of_token_ids_equals_grpc(http_stack: HttpStack) -> None:
    ids = [5, 6, 7, 300, 41]
    expected = http_stack.grpc(prompt_token_ids=ids, max_tokens=10, temperature=0.0, ignore_eos=True)
    for prompt in (ids, [ids]):
        result = http_stack.client.completions.create(
            model=MODEL_ID, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        assert result.choices[0].text == expected.text
        assert result.usage is not None and result.usage.prompt_tokens == len(ids)


BATCH: list[Any] = ["The capital of France is", [5, 6, 7, 300, 41], "héllo wörld"]


def _single(http_stack: HttpStack, prompt: Any, **fields: Any) -> Any:
    return http_stack.client.completions.create(model=MODEL_ID, prompt=prompt, **fields)


@pytest.mark.parametrize("prompts", [BATCH[::2], [BATCH[1], [9, 8, 7]]], ids=["texts", "token ids"])
def test_a_batch_of_prompts_answers_each_as_its_own_request(
    http_stack: HttpStack, prompts: list[Any]
) -> None:
    """vLLM's batched ``prompt``: prompt p's choice i is choice p * n + i; the usage counts every
    prompt once and every choice's tokens, whole or streamed."""
    fields: dict[str, Any] = {"max_tokens": 6, "temperature": 0.9, "seed": 5, "n": 2}
    fields["extra_body"] = {"ignore_eos": True}
    singles = [_single(http_stack, prompt, **fields) for prompt in prompts]
    expected = {2 * p + c.index: c.text for p, single in enumerate(singles) for c in single.choices}
    assert len(set(expected.values())) > 1
    prompt_tokens = sum(single.usage.prompt_tokens for single in singles)

    whole = _single(http_stack, prompts, **fields)
    assert {c.index: c.text for c in whole.choices} == expected
    assert [c.index for c in whole.choices] == list(range(2 * len(prompts)))
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 6 * len(expected))

    streamed: dict[int, str] = {}
    chunks = list(_single(http_stack, prompts, stream=True, stream_options={"include_usage": True}, **fields))
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == expected
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 6 * len(expected))


def test_a_batch_echoes_each_prompt_with_its_logprobs(http_stack: HttpStack) -> None:
    fields: dict[str, Any] = {"max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}
    prompts = BATCH[::2]
    singles = [_single(http_stack, prompt, **fields).choices[0] for prompt in prompts]
    batch = _single(http_stack, prompts, **fields).choices
    assert [c.text for c in batch] == [c.text for c in singles]
    assert [c.text[: len(p)] for c, p in zip(batch, prompts, strict=True)] == prompts
    for got, want in zip(batch, singles, strict=True):
        assert got.logprobs is not None and want.logprobs is not None
        assert got.logprobs.tokens == want.logprobs.tokens
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs)


def test_a_request_id_at_the_bound_names_the_response(http_stack: HttpStack) -> None:
    for prompt in ("hi", ["hi", "yo"]):
        status, body = http_post(
            http_stack.http,
            "/v1/completions",
            json.dumps({"prompt": prompt, "max_tokens": 1, "request_id": "r" * 256}).encode(),
        )
        assert status == 200, body
        assert body["id"] == "cmpl-" + "r" * 256


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids(http_stack: HttpStack) -> None:
    """vLLM's ``return_token_ids``: each choice's prompt and generated ids, whole or streamed (the
    prompt's ids with a choice's first chunk, each chunk's own tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(http_stack.model_dir)
    prompts = ["The capital of France is", [5, 6, 7, 300, 41]]
    prompt_ids = [tokenizer(prompts[0]).input_ids, prompts[1]]
    generated = [
        http_stack.grpc(prompt_token_ids=ids, max_tokens=5, temperature=0.0, ignore_eos=True).token_ids
        for ids in prompt_ids
    ]
    fields: dict[str, Any] = {"model": MODEL_ID, "max_tokens": 5, "temperature": 0}
    fields["extra_body"] = {"ignore_eos": True, "return_token_ids": True}
    for p, prompt in enumerate(prompts):
        [choice] = http_stack.client.completions.create(prompt=prompt, **fields).choices
        assert choice.model_extra is not None
        assert (choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]) == (
            prompt_ids[p],
            generated[p],
        )
    batch = http_stack.client.completions.create(prompt=[[9, 8, 7], prompt_ids[1]], n=2, **fields).choices
    extra = [c.model_extra or {} for c in batch]
    assert [e["prompt_token_ids"] for e in extra] == [[9, 8, 7]] * 2 + [prompt_ids[1]] * 2
    assert [e["token_ids"] for e in extra[2:]] == [generated[1]] * 2
    chunks = list(http_stack.client.completions.create(prompt=prompts[0], stream=True, **fields))
    extras = [c.choices[0].model_extra or {} for c in chunks]
    assert [e.get("prompt_token_ids") for e in extras] == [prompt_ids[0]] + [None] * (len(chunks) - 1)
    assert [t for e in extras for t in e["token_ids"]] == generated[0]
    echo = http_stack.client.completions.create(
        prompt=prompts[1], **{**fields, "max_tokens": 0, "echo": True}
    )
    extra_echo = echo.choices[0].model_extra or {}
    assert (extra_echo["prompt_token_ids"], extra_echo["token_ids"]) == (prompt_ids[1], [])
    plain = http_stack.client.completions.create(prompt=prompts[1], model=MODEL_ID, max_tokens=2)
    assert not {"prompt_token_ids", "token_ids"} & set(plain.choices[0].model_extra or {})  # unless asked


def test_chat_return_token_ids(http_stack: HttpStack) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    status, tokenized = http_post(http_stack.http, "/tokenize", json.dumps({"messages": messages}).encode())
    assert status == 200, tokenized
    fields: dict[str, Any] = {"model": MODEL_ID, "messages": messages, "max_tokens": 6, "temperature": 0}
    fields["extra_body"] = {"ignore_eos": True, "return_token_ids": True}
    generated = http_stack.grpc(
        prompt_token_ids=tokenized["tokens"], max_tokens=6, temperature=0.0, ignore_eos=True
    )
    whole = http_stack.client.chat.completions.create(**fields)
    assert whole.model_extra is not None and whole.model_extra["prompt_token_ids"] == tokenized["tokens"]
    assert (whole.choices[0].model_extra or {})["token_ids"] == generated.token_ids
    chunks = list(http_stack.client.chat.completions.create(stream=True, **fields))
    assert [(c.model_extra or {}).get("prompt_token_ids") for c in chunks] == [tokenized["tokens"]] + [
        None
    ] * (len(chunks) - 1)
    streamed = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
    assert streamed == generated.token_ids


def test_continuous_usage_stats_count_each_choice_as_it_streams(http_stack: HttpStack) -> None:
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk has its
    choice's usage so far, against its own prompt's tokens."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    fields: dict[str, Any] = {"model": MODEL_ID, "max_tokens": 4, "temperature": 0, "n": 2, "stream": True}
    fields["extra_body"] = {"ignore_eos": True}
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4]]
    chunks = list(http_stack.client.completions.create(prompt=prompts, stream_options=options, **fields))
    seen: dict[int, list[int]] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        assert chunk.usage is not None
        assert chunk.usage.prompt_tokens == len(prompts[choice.index // 2])
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        seen.setdefault(choice.index, []).append(chunk.usage.completion_tokens)
    assert sorted(seen) == [0, 1, 2, 3]
    assert all(counts == sorted(counts) and counts[-1] == 4 for counts in seen.values())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16  # the whole request's

    messages = [{"role": "user", "content": "hi"}]
    chat = list(
        http_stack.client.chat.completions.create(messages=messages, stream_options=options, **fields)
    )
    roles = [c for c in chat if c.choices and c.choices[0].delta.role == "assistant"]
    assert len(roles) == 2 and all(c.usage is not None and c.usage.completion_tokens == 0 for c in roles)
    assert all(c.usage is not None for c in chat)
    finals = [c.usage.completion_tokens for c in chat if c.choices and c.choices[0].finish_reason and c.usage]
    assert finals == [4, 4]
    plain = list(http_stack.client.chat.completions.create(messages=messages, **{**fields, "n": 1}))
    assert all(c.usage is None for c in plain)  # without include_usage: nothing


def test_usage_counts_the_prompt_tokens_taken_from_the_prefix_cache(http_stack: HttpStack) -> None:
    """As OpenAI and vLLM: ``usage.prompt_tokens_details.cached_tokens`` (whole 16-token blocks the
    prefill did not compute again; the prompt's last token always runs)."""
    ids = [(7 * i + 11) % 900 + 3 for i in range(40)]
    fresh = http_stack.client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=2, temperature=0)
    again = http_stack.client.completions.create(model=MODEL_ID, prompt=ids, max_tokens=2, temperature=0)
    streamed = list(
        http_stack.client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert fresh.usage is not None and again.usage is not None
    assert fresh.usage.prompt_tokens_details is not None and again.usage.prompt_tokens_details is not None
    assert (
        fresh.usage.prompt_tokens_details.cached_tokens,
        again.usage.prompt_tokens_details.cached_tokens,
    ) == (
        0,
        32,
    )
    assert again.choices[0].text == fresh.choices[0].text
    usage = streamed[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    grpc_again = http_stack.grpc(prompt_token_ids=ids, max_tokens=2, temperature=0.0)
    assert [c.num_cached_tokens for c in grpc_again.chunks] == [32] + [0] * (len(grpc_again.chunks) - 1)


def test_eos_is_stop_and_ignore_eos_runs_on(http_stack: HttpStack) -> None:
    ended = http_stack.client.completions.create(
        model=MODEL_ID, prompt=EOS_PROMPT, max_tokens=8, temperature=0
    )
    assert ended.choices[0].finish_reason == "stop"
    assert ended.usage is not None and ended.usage.completion_tokens == 1
    streamed = list(
        http_stack.client.completions.create(
            model=MODEL_ID, prompt=EOS_PROMPT, max_tokens=8, temperature=0, stream=True
        )
    )
    assert streamed[-1].choices[0].finish_reason == "stop"
    ignored = http_stack.client.completions.create(
        model=MODEL_ID, prompt=EOS_PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage is not None and ignored.usage.completion_tokens == 8


def test_stop_strings(http_stack: HttpStack) -> None:
    prompt = "Once upon a time"
    full = http_stack.grpc(prompt=prompt, max_tokens=48, temperature=0.0, ignore_eos=True).text
    stop = next(
        full[i : i + 3]
        for i in range(8, len(full) - 3)
        if full[i : i + 3].strip() == full[i : i + 3] and full.index(full[i : i + 3]) == i
    )
    for stops in (stop, [stop, "\x00never"]):
        result = http_stack.client.completions.create(
            model=MODEL_ID,
            prompt=prompt,
            max_tokens=48,
            temperature=0,
            stop=stops,
            extra_body={"ignore_eos": True},
        )
        assert result.choices[0].text == full[: full.index(stop)]
        assert result.choices[0].finish_reason == "stop"
        assert result.usage is not None and result.usage.completion_tokens < 48
    streamed = http_stack.client.completions.create(
        model=MODEL_ID,
        prompt=prompt,
        max_tokens=48,
        temperature=0,
        stop=[stop],
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_top_k_and_seed(http_stack: HttpStack) -> None:
    prompt = "The weather today"

    def sampled(**extra: Any) -> str:
        result = http_stack.client.completions.create(
            model=MODEL_ID,
            prompt=prompt,
            max_tokens=16,
            temperature=1.0,
            seed=7,
            extra_body={"ignore_eos": True, **extra},
        )
        return result.choices[0].text

    greedy = http_stack.grpc(prompt=prompt, max_tokens=16, temperature=0.0, ignore_eos=True).text
    assert sampled(top_k=1) == greedy
    free = sampled()
    assert free != greedy
    assert sampled() == free
    assert sampled(top_k=-1) == free  # vLLM's "off"
    seeded = http_stack.grpc(prompt=prompt, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    assert free == seeded.text


# --- chat completions ----------------------------------------------------------------------------


def test_chat_equals_grpc_chat(http_stack: HttpStack) -> None:
    expected = http_stack.grpc(
        prompt="hi there", apply_chat_template=True, max_tokens=12, temperature=0.0, ignore_eos=True
    )
    result = http_stack.client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "hi there"}],
        max_completion_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.text
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert result.usage.prompt_tokens == expected.chunks[0].num_prompt_tokens
    assert result.usage.completion_tokens == 12

    chunks = list(
        http_stack.client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == expected.text
    assert content[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 12


def test_chat_template_covers_the_whole_conversation(http_stack: HttpStack) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "text", "text": "Another "}, {"type": "text", "text": "one?"}]},
    ]
    tokenizer = AutoTokenizer.from_pretrained(http_stack.model_dir)
    conversation = [
        {"role": m["role"], "content": m["content"] if isinstance(m["content"], str) else "Another one?"}
        for m in messages
    ]
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    expected = http_stack.grpc(prompt_token_ids=ids, max_tokens=10, temperature=0.0, ignore_eos=True)
    result = http_stack.client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.usage is not None and result.usage.prompt_tokens == len(ids)
    assert result.choices[0].message.content == expected.text


# --- errors --------------------------------------------------------------------------------------

COMPLETION: dict[str, Any] = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 4}
CHAT: dict[str, Any] = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

ERROR_CASES: list[tuple[str, str, Any, int, str | None, str | None]] = [
    # (case, path, body, status, param, code)
    ("bad temperature", "/v1/completions", {**COMPLETION, "temperature": -1}, 400, "temperature", None),
    ("max_tokens 0", "/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", None),
    ("prompt too long", "/v1/completions", {**COMPLETION, "prompt": [5] * 2100}, 400, "prompt", None),
    (
        "token outside vocabulary",
        "/v1/completions",
        {**COMPLETION, "prompt": [5, 10**6]},
        400,
        "prompt",
        None,
    ),
    ("empty prompt", "/v1/completions", {**COMPLETION, "prompt": ""}, 400, "prompt", None),
    ("empty batch", "/v1/completions", {**COMPLETION, "prompt": []}, 400, "prompt", None),
    (
        "batch with an empty prompt",
        "/v1/completions",
        {**COMPLETION, "prompt": ["a", ""]},
        400,
        "prompt",
        None,
    ),
    (
        "batch with a prompt too long",
        "/v1/completions",
        {**COMPLETION, "prompt": [[5], [5] * 2100]},
        400,
        "prompt",
        None,
    ),
    (
        "streamed batch with a prompt too long",
        "/v1/completions",
        {**COMPLETION, "prompt": [[5], [5] * 2100], "stream": True},
        400,
        "prompt",
        None,
    ),
    (
        "batch past max-in-flight",
        "/v1/completions",
        {**COMPLETION, "prompt": ["a"] * 257},
        400,
        "prompt",
        None,
    ),
    ("top_p zero", "/v1/completions", {**COMPLETION, "top_p": 0}, 400, "top_p", None),
    ("empty stop", "/v1/completions", {**COMPLETION, "stop": [""]}, 400, "stop", None),
    ("n=0", "/v1/completions", {**COMPLETION, "n": 0}, 400, "n", None),
    ("unknown model", "/v1/completions", {**COMPLETION, "model": "gpt-9"}, 404, "model", "model_not_found"),
    (
        "max_tokens not a number",
        "/v1/completions",
        {**COMPLETION, "max_tokens": "x"},
        400,
        "max_tokens",
        None,
    ),
    ("malformed JSON", "/v1/completions", b'{"prompt": "hi",', 400, None, None),
    ("chat n beyond max_n", "/v1/chat/completions", {**CHAT, "n": 17}, 400, "n", None),
    ("chat unknown model", "/v1/chat/completions", {**CHAT, "model": "x"}, 404, "model", "model_not_found"),
    ("chat no messages", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", None),
    (
        "chat image part",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        400,
        "messages",
        None,
    ),
    (
        "chat max_completion_tokens 0",
        "/v1/chat/completions",
        {**CHAT, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        None,
    ),
    (
        "chat too long",
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "word " * 2100}]},
        400,
        "messages",
        None,
    ),
]


@pytest.mark.parametrize(
    ("case", "path", "body", "status", "param", "code"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES]
)
def test_errors_have_openai_shape(
    http_stack: HttpStack,
    case: str,
    path: str,
    body: Any,
    status: int,
    param: str | None,
    code: str | None,
) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, answer = http_post(http_stack.http, path, raw)
    assert got == status, f"{case}: {got} {answer}"
    assert set(answer) == {"error"}
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code, f"{case}: {error}"
    assert error["message"] and "Traceback" not in error["message"]


def test_client_raises_openai_errors(http_stack: HttpStack) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        http_stack.client.completions.create(model=MODEL_ID, prompt="hi", temperature=-1)
    assert "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        http_stack.client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        list(http_stack.client.completions.create(model=MODEL_ID, prompt="hi", max_tokens=0, stream=True))


def test_unavailable_backend_is_503_and_the_gateway_stops_cleanly(cache_dir: Path, tmp_path: Path) -> None:
    dead = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dead.append(f"127.0.0.1:{sock.getsockname()[1]}")
    gateway = ServiceProcess(
        "gateway",
        [
            *("--model", "tiny-llama", "--host", "127.0.0.1", "--port", "0", "--http-port", "0"),
            *("--prefill", dead[0], "--decode", dead[1]),
        ],
        {**service_env(cache_dir), "PDSERVE_API_KEY": "sk-test"},
        tmp_path / "gateway.log",
    )
    gateway.start()
    try:
        address = str(gateway.wait_ready()["http"])
        body = json.dumps({"prompt": "hi"}).encode()
        status, answer = http_post(address, "/v1/completions", body)
        assert (status, answer["error"]["code"]) == (401, "invalid_api_key"), answer
        assert http_post(address, "/v1/completions", body, key="sk-wrong")[0] == 401
        status, answer = http_post(address, "/v1/completions", body, key="sk-test")
        assert status == 503, answer
        assert answer["error"]["type"] == "server_error"
        assert answer["error"]["code"] == "service_unavailable"
        assert http_get(address, "/health")[0] == 200
        assert http_get(address, "/metrics")[0] == 200, "probes and scrapers need no key"
        assert "sk-test" not in gateway.log_tail(20000)
    finally:
        assert gateway.stop() == 0, gateway.log_tail()


# --- metrics -------------------------------------------------------------------------------------

REQUEST_HISTOGRAMS = (
    "pdserve_e2e_request_latency_seconds",
    "pdserve_time_to_first_token_seconds",
    "pdserve_request_time_per_output_token_seconds",
    "pdserve_request_queue_time_seconds",
    "pdserve_request_prompt_tokens",
    "pdserve_request_generation_tokens",
)


def test_metrics_on_the_http_port(http_stack: HttpStack) -> None:
    """Three requests (HTTP whole and streamed, gRPC) in the vLLM-shaped histograms of /metrics on
    the HTTP port, the same registry as --metrics-port; the decode's KV usage and the prefill's queue."""
    stack, http = http_stack.stack, http_stack.http
    assert stack.gateway is not None
    model = f"model_name={MODEL_ID}"
    before = scrape(http)
    lengths = (6, 5, 4)
    http_stack.client.completions.create(
        model=MODEL_ID, prompt="Hello", max_tokens=lengths[0], temperature=0, extra_body={"ignore_eos": True}
    )
    chat = http_stack.client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=lengths[1],
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert list(chat)
    http_stack.grpc(prompt_token_ids=[5, 6, 7], max_tokens=lengths[2], temperature=0.0, ignore_eos=True)

    after = scrape(http)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    for name in REQUEST_HISTOGRAMS:
        assert delta(f"{name}_count{{{model}}}") == 3, name
        assert after[f"{name}_bucket{{le=+Inf,{model}}}"] == after[f"{name}_count{{{model}}}"]
    assert delta(f"pdserve_inter_token_latency_seconds_count{{{model}}}") == sum(lengths) - len(lengths)
    assert delta(f"pdserve_request_generation_tokens_sum{{{model}}}") == sum(lengths)
    assert delta(f"pdserve_generation_tokens_total{{{model}}}") == sum(lengths)
    assert delta(f"pdserve_request_prompt_tokens_sum{{{model}}}") == delta(
        f"pdserve_prompt_tokens_total{{{model}}}"
    )
    assert delta(f"pdserve_request_success_total{{finished_reason=length,{model}}}") == 3
    assert delta(f"pdserve_request_success_total{{finished_reason=abort,{model}}}") == 0
    same = "pdserve_request_success_total{finished_reason=length," + model + "}"
    assert scrape(stack.gateway.metrics)[same] == after[same], "one registry on both ports"
    status, _ = http_get(http, "/metrics")
    assert status == 200

    prefill = scrape(stack.prefills[0].metrics)
    assert prefill["pdserve_prefill_waiting"] == 0 and prefill["pdserve_prefill_running"] == 0
    assert prefill["pdserve_prefill_queue_seconds_count"] >= 3
    # A long request holds KV blocks of the decode while it runs.
    body: dict[str, Any] = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": LONG, "stream": True}
    sock = open_request(http, "/v1/completions", body | {"temperature": 0, "ignore_eos": True})
    try:
        read_events(sock, 4)
        usage = scrape(stack.decodes[0].metrics)["pdserve_decode_kv_cache_usage_ratio"]
        assert 0 < usage <= 1, usage
    finally:
        sock.close()
    assert wait_for(lambda: scrape(stack.decodes[0].metrics)["pdserve_decode_kv_cache_usage_ratio"] == 0, 15)
    assert wait_for(lambda: delta_abort(http, before, model) == 1, 15), "the cancelled request is an abort"


def delta_abort(http: str, before: dict[str, float], model: str) -> float:
    name = f"pdserve_request_success_total{{finished_reason=abort,{model}}}"
    return scrape(http)[name] - before.get(name, 0.0)


# --- cancellation --------------------------------------------------------------------------------


def open_request(address: str, path: str, body: dict[str, Any]) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    raw = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return sock


def read_events(sock: socket.socket, count: int) -> bytes:
    received = b""
    while received.count(b"data: ") < count:
        data = sock.recv(65536)
        assert data, f"the server closed the stream early: {received!r}"
        received += data
    return received


def gateway_metric(stack: Stack, name: str) -> float:
    assert stack.gateway is not None
    return scrape(stack.gateway.metrics).get(name, 0.0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_cancels_decode(http_stack: HttpStack, path: str) -> None:
    stack = http_stack.stack
    cancelled = gateway_metric(stack, "pdserve_gateway_cancelled_total")
    finished = gateway_metric(stack, "pdserve_gateway_finished_total{reason=length}")
    body: dict[str, Any] = {"model": MODEL_ID, "max_tokens": LONG, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True}
    body |= (
        {"prompt": "Hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    )
    sock = open_request(http_stack.http, path, body)
    try:
        head = read_events(sock, 4)
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    finally:
        sock.close()
    assert wait_for(lambda: gateway_metric(stack, "pdserve_gateway_cancelled_total") == cancelled + 1, 15)
    assert_no_leaks(stack)
    assert gateway_metric(stack, "pdserve_gateway_finished_total{reason=length}") == finished
    assert gateway_metric(stack, "pdserve_gateway_in_flight") == 0


def test_disconnect_while_waiting_for_a_whole_completion_cancels_decode(http_stack: HttpStack) -> None:
    stack = http_stack.stack
    cancelled = gateway_metric(stack, "pdserve_gateway_cancelled_total")
    finished = gateway_metric(stack, "pdserve_gateway_finished_total{reason=length}")
    body = {"model": MODEL_ID, "prompt": "Hello", "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    sock = open_request(http_stack.http, "/v1/completions", body)
    try:
        assert wait_for(
            lambda: any(scrape(d.metrics)["pdserve_decode_running"] for d in stack.decodes), 15, 0.01
        )
    finally:
        sock.close()
    assert wait_for(lambda: gateway_metric(stack, "pdserve_gateway_cancelled_total") == cancelled + 1, 15)
    assert_no_leaks(stack)
    assert gateway_metric(stack, "pdserve_gateway_finished_total{reason=length}") == finished


# --- pdserve up ----------------------------------------------------------------------------------


def test_up_announces_and_serves_http(cache_dir: Path, tmp_path: Path) -> None:
    with pdserve_up(
        cache_dir, tmp_path / "up.log", "--model", "tiny-llama", "--port", "0", "--http-port", "0"
    ) as (up, ready):
        address = ready["gateway"]["http"]
        assert http_get(address, "/health") == (200, b"")
        client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-llama"]
        result = client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=3, temperature=0)
        assert result.usage is not None and result.usage.prompt_tokens == 3
        assert f"curl http://{address}/v1/chat/completions" in (tmp_path / "up.log").read_text()
        requests = scrape(address)[
            "pdserve_request_success_total{finished_reason=length,model_name=tiny-llama}"
        ]
        assert requests == 1, "/metrics on the HTTP port"
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0


def test_up_passes_and_pins_the_http_port() -> None:
    from pdserve.launch import spec as launcher

    config = launcher.UpConfig(http_port=0)
    spec = launcher.LaunchSpec(
        launcher.GATEWAY, http_port=config.http_port, prefill=("h:1",), decode=("h:2",)
    )
    command = launcher.service_command(config, spec)
    assert command[command.index("--http-port") + 1] == "0"
    pinned = launcher.pin_ports(spec, {"grpc": "h:3", "metrics": "h:4", "http": "h:8123"})
    assert pinned.http_port == 8123
    assert launcher.pin_ports(launcher.LaunchSpec(launcher.GATEWAY), {"grpc": "h:3"}).http_port == -1
    default = launcher.service_command(launcher.UpConfig(), dataclasses.replace(spec, http_port=8000))
    assert launcher.UpConfig().http_port == 8000 and default[default.index("--http-port") + 1] == "8000"
    with pytest.raises(ValueError, match="http_port"):
        launcher.UpConfig(http_port=-2)


def test_gateway_config_http_port() -> None:
    from pdserve.config import GatewayConfig

    base = {"prefill": ("h:1",), "decode": ("h:2",)}
    assert GatewayConfig(**base).http_port == 8000
    assert GatewayConfig(**base, model="m").model_id == "m"
    assert GatewayConfig(**base, model="m", served_model_name="n").model_id == "n"
    for bad in (-2, 65536):
        with pytest.raises(ValueError, match=r"^http_port must be -1"):
            GatewayConfig(**base, http_port=bad)
