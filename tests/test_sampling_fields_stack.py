"""The sampling fields through the disaggregated stack (real processes, the official `openai`
client): penalties, min_tokens, logit_bias, the model's generation_config defaults, stop_reason and
include_stop_str_in_output, and a 400 for every refused vLLM field.

The stack serves a copy of tiny-llama whose EOS is the greedy first token of EOS_PROMPT and whose
generation_config.json sets sampling defaults (``GENERATION``), as a model's may.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from transformers import DynamicCache

from gateway.bad_words import bad_words_token_ids
from pdserve.core.finish import finish_reason
from pdserve.core.logits_processing import pick, request_processor
from pdserve.core.sampling import SamplingParams
from pdserve.rpc.sampling_proto import sampling_from_proto, sampling_to_proto
from pdserve.v1 import decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from tests.conftest import EOS_PROMPT, assert_no_leaks, eos_model_copy
from tests.grpc_client import expect_error, generate_many, make_request, run
from tests.stack import Stack, internal_aio_channel

MODEL_ID = "tiny-llama-sampling"
GENERATION = {"repetition_penalty": 1.3, "temperature": 0.7, "top_k": 8, "top_p": 0.95, "min_p": 0.02}
PROMPTS = [[3, 14, 15, 92, 65], [7] * 12, list(range(100, 140))]


class SamplingStack:
    def __init__(self, stack: Stack, eos: int, model: Any, tokenizer: Any) -> None:
        self.stack = stack
        self.eos = eos
        self.model = model
        self.tokenizer = tokenizer
        assert stack.gateway is not None
        self.client = openai.OpenAI(
            base_url=f"http://{stack.gateway.ready['http']}/v1", api_key="unused", max_retries=0
        )

    def hf_greedy(self, prompt: list[int], max_tokens: int, **kwargs: Any) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=[self.eos],
                pad_token_id=0,
                **kwargs,
            )
        return [int(t) for t in out[0, len(prompt) :]]


@pytest.fixture(scope="module")
def sampling_stack(
    cache_dir: Path, reference_models: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SamplingStack]:
    model_dir, eos = eos_model_copy(cache_dir, reference_models, tmp_path_factory.mktemp("sampling-model"))
    path = model_dir / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **GENERATION}))
    stack = Stack(
        str(model_dir),
        cache_dir,
        tmp_path_factory.mktemp("sampling-logs"),
        gateway_args=["--http-port", "0", "--served-model-name", MODEL_ID],
    ).start()
    model, tokenizer = reference_models("tiny-llama")
    try:
        yield SamplingStack(stack, eos, model, tokenizer)
    finally:
        stack.stop()


@pytest.fixture(autouse=True)
def leak_check_sampling(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "sampling_stack" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("sampling_stack").stack)


def greedy(repetition_penalty: float) -> dict[str, float]:
    return {"temperature": 0.0, "repetition_penalty": repetition_penalty}


# --- equality with one-process references --------------------------------------------------------


def test_greedy_repetition_penalty_equals_transformers_generate(sampling_stack: SamplingStack) -> None:
    s = sampling_stack
    requests = [
        make_request(prompt_token_ids=p, max_tokens=12, temperature=0.0, repetition_penalty=1.8)
        for p in PROMPTS
    ]
    results = asyncio.run(generate_many(s.stack.address, requests))
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.token_ids == s.hf_greedy(prompt, 12, repetition_penalty=1.8)
    plain = s.hf_greedy(PROMPTS[1], 12)
    assert plain != s.hf_greedy(PROMPTS[1], 12, repetition_penalty=1.8)  # the penalty changes the tokens


def test_generation_config_defaults_apply_when_omitted(sampling_stack: SamplingStack) -> None:
    """The model's repetition_penalty (1.3) applies to requests that omit it, on both APIs."""
    s = sampling_stack
    prompt = PROMPTS[1]
    expected = s.hf_greedy(prompt, 10, repetition_penalty=GENERATION["repetition_penalty"])
    assert run(
        s.stack.address, make_request(prompt_token_ids=prompt, max_tokens=10, temperature=0.0)
    ).token_ids == (expected)
    explicit = run(s.stack.address, make_request(prompt_token_ids=prompt, max_tokens=10, **greedy(1.3)))
    assert explicit.token_ids == expected
    got = s.client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=10, temperature=0)
    assert got.choices[0].text == explicit.text
    off = s.client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=10, temperature=0, extra_body={"repetition_penalty": 1.0}
    )
    plain = run(s.stack.address, make_request(prompt_token_ids=prompt, max_tokens=10, **greedy(1.0)))
    assert plain.token_ids == s.hf_greedy(prompt, 10)
    assert off.choices[0].text == plain.text != explicit.text


def test_min_tokens_masks_eos_through_the_stack(sampling_stack: SamplingStack) -> None:
    s = sampling_stack
    base = {"prompt_token_ids": EOS_PROMPT, "max_tokens": 6, "temperature": 0.0, "repetition_penalty": 1.0}
    assert run(s.stack.address, make_request(**base)).token_ids == [s.eos]
    result = run(s.stack.address, make_request(**base, min_tokens=3))
    assert result.token_ids == s.hf_greedy(EOS_PROMPT, 6, min_new_tokens=3)
    assert len(result.token_ids) >= 3 and s.eos not in result.token_ids[:3]


def one_process(s: SamplingStack, prompt: list[int], params: SamplingParams) -> list[int]:
    """Prefill then decode in one process with the shared processors and sampler: the reference."""
    cache = DynamicCache(config=s.model.config)
    processor = request_processor(params, {s.eos}, prompt, 0)
    tokens: list[int] = []
    with torch.no_grad():
        logits = s.model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
        while True:
            token = pick(logits, params, len(tokens), processor)
            if processor is not None:
                processor.append(token)
            tokens.append(token)
            if finish_reason(token, len(tokens), params, {s.eos}) is not None:
                return tokens
            logits = s.model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]


SEEDED = (
    {"temperature": 1.0, "seed": 1, "presence_penalty": 1.5, "frequency_penalty": 0.5},
    {"temperature": 0.8, "seed": 2, "repetition_penalty": 1.4, "min_p": 0.1, "top_k": 20},
    {
        "temperature": 1.2,
        "seed": 3,
        "logit_bias": {5: 3.0, 6: -100.0},
        "min_tokens": 4,
        "frequency_penalty": -0.5,
    },
)


def test_seeded_sampling_with_penalties_matches_one_process(sampling_stack: SamplingStack) -> None:
    s = sampling_stack
    requests = [
        make_request(prompt_token_ids=p, max_tokens=16, **fields)
        for p, fields in zip(PROMPTS, SEEDED, strict=True)
    ]
    results = asyncio.run(generate_many(s.stack.address, requests))
    # What the gateway sends the engines for the omitted fields: the model's, as float32.
    defaults = sampling_from_proto(sampling_to_proto(SamplingParams(**GENERATION)))  # type: ignore[arg-type]
    for prompt, request, result in zip(PROMPTS, requests, results, strict=True):
        params = sampling_from_proto(request.sampling, defaults)
        assert result.token_ids == one_process(s, prompt, params), f"settings {request.sampling}"
    again = asyncio.run(generate_many(s.stack.address, requests))
    assert [r.token_ids for r in again] == [r.token_ids for r in results]


def bad_words_request(prompt: list[int], bad: list[list[int]], **fields: Any) -> Any:
    request = make_request(prompt_token_ids=prompt, max_tokens=12, **greedy(1.0), **fields)
    for sequence in bad:
        request.sampling.bad_words_token_ids.add(token_ids=sequence)
    return request


def test_greedy_bad_words_equal_transformers_generate(sampling_stack: SamplingStack) -> None:
    """One-token and two-token bad words against ``generate(bad_words_ids=...)``, whose rule is
    vLLM's once the word's prefix lies in the output (the prompt's last token is not its prefix)."""
    s = sampling_stack
    prompt = PROMPTS[0]
    plain = run(s.stack.address, bad_words_request(prompt, [])).token_ids
    assert plain == s.hf_greedy(prompt, 12)
    i = next(i for i in range(1, 10) if plain[i] != prompt[-1])
    for bad in ([[plain[0]]], [[plain[i], plain[i + 1]]], [[plain[0]], [plain[i], plain[i + 1]]]):
        result = run(s.stack.address, bad_words_request(prompt, bad))
        assert result.token_ids == s.hf_greedy(prompt, 12, bad_words_ids=bad), bad
        assert result.token_ids != plain
    seeded = bad_words_request(prompt, [[plain[0]]], seed=4)
    seeded.sampling.temperature = 1.0
    defaults = sampling_from_proto(sampling_to_proto(SamplingParams(**GENERATION)))  # type: ignore[arg-type]
    params = sampling_from_proto(seeded.sampling, defaults)
    assert run(s.stack.address, seeded).token_ids == one_process(s, prompt, params)


def test_bad_words_as_text_over_http_and_grpc(sampling_stack: SamplingStack) -> None:
    """Words are tokenized by the gateway as vLLM does, the same for both APIs."""
    s = sampling_stack
    prompt = PROMPTS[2]
    word = s.tokenizer.decode(s.hf_greedy(prompt, 2)).strip()
    assert word
    sequences = bad_words_token_ids((word,), s.tokenizer)
    by_ids = run(s.stack.address, bad_words_request(prompt, [list(q) for q in sequences]))
    by_text = run(s.stack.address, bad_words_request(prompt, [], bad_words=[word]))
    http = s.client.completions.create(
        model=MODEL_ID, prompt=prompt, max_tokens=12, extra_body={**greedy(1.0), "bad_words": [word]}
    )
    assert by_text.token_ids == by_ids.token_ids
    assert http.choices[0].text == by_ids.text
    for hostile in ([[5] * 4097], [[5]] * 129, [[10**6]]):  # too long, too many, outside the vocabulary
        error = expect_error(s.stack.address, bad_words_request(prompt, hostile))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad_words" in (error.details() or "")
    for bad in (["   "], ["x"] * 129, ["x" * 17000]):  # no token, too many, too many bytes
        with pytest.raises(openai.BadRequestError) as error:
            s.client.completions.create(
                model=MODEL_ID, prompt=prompt, max_tokens=2, extra_body={"bad_words": bad}
            )
        assert "bad_words" in error.value.message


# --- stop_reason and include_stop_str_in_output --------------------------------------------------


def test_stop_reason_and_include_stop_str_through_the_openai_client(sampling_stack: SamplingStack) -> None:
    s = sampling_stack
    prompt = PROMPTS[2]
    fields = {"temperature": 0.0, "repetition_penalty": 1.0}
    tokens = s.hf_greedy(prompt, 12)
    assert len(tokens) == 12, tokens
    full = s.client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=12, extra_body=fields)
    text = full.choices[0].text
    assert full.choices[0].finish_reason == "length" and full.choices[0].stop_reason is None  # type: ignore[attr-defined]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and text.count(stop) == 1, text
    before = text[: text.index(stop)]
    for include in (False, True):
        body = {**fields, "include_stop_str_in_output": include}
        expected = before + stop if include else before
        got = s.client.completions.create(
            model=MODEL_ID, prompt=prompt, max_tokens=12, stop=[stop], extra_body=body
        )
        choice = got.choices[0]
        assert (choice.text, choice.finish_reason, choice.stop_reason) == (expected, "stop", stop)  # type: ignore[attr-defined]
        chunks = list(
            s.client.completions.create(
                model=MODEL_ID, prompt=prompt, max_tokens=12, stop=[stop], stream=True, extra_body=body
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].stop_reason == stop  # type: ignore[attr-defined]
    # A stop token: its id is the stop_reason; its text is returned only with include_stop_str_in_output.
    token = tokens[3]
    assert token not in tokens[:3], tokens
    head = run(s.stack.address, make_request(prompt_token_ids=prompt, max_tokens=3, **fields)).text
    with_token = run(s.stack.address, make_request(prompt_token_ids=prompt, max_tokens=4, **fields)).text
    assert head != with_token
    messages = [{"role": "user", "content": "x"}]
    for include in (False, True):
        body = {**fields, "stop_token_ids": [token], "include_stop_str_in_output": include}
        got = s.client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=12, extra_body=body)
        choice = got.choices[0]
        assert (choice.text, choice.stop_reason) == (with_token if include else head, token)  # type: ignore[attr-defined]
        assert got.usage is not None and got.usage.completion_tokens == 4
    chat = s.client.chat.completions.create(
        model=MODEL_ID, messages=messages, max_tokens=12, extra_body={**fields, "ignore_eos": True}
    )
    chat_text = chat.choices[0].message.content or ""
    chat_stop = chat_text[2:5]
    assert chat_stop.strip(), chat_text
    got_chat = s.client.chat.completions.create(
        model=MODEL_ID,
        messages=messages,
        max_tokens=12,
        stop=[chat_stop],
        extra_body={**fields, "ignore_eos": True},
    )
    assert got_chat.choices[0].message.content == chat_text[: chat_text.index(chat_stop)]
    assert got_chat.choices[0].stop_reason == chat_stop  # type: ignore[attr-defined]
    streamed = list(
        s.client.chat.completions.create(
            model=MODEL_ID,
            messages=messages,
            max_tokens=12,
            stop=[chat_stop],
            stream=True,
            extra_body={**fields, "ignore_eos": True, "include_stop_str_in_output": True},
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed)
        == chat_text[: chat_text.index(chat_stop) + len(chat_stop)]
    )
    last = streamed[-1].choices[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", chat_stop)  # type: ignore[attr-defined]
    eos = s.client.completions.create(model=MODEL_ID, prompt=EOS_PROMPT, max_tokens=4, extra_body=fields)
    assert (eos.choices[0].finish_reason, eos.choices[0].stop_reason) == ("stop", None)  # type: ignore[attr-defined]


def test_grpc_response_names_the_stop(sampling_stack: SamplingStack) -> None:
    s = sampling_stack
    tokens = s.hf_greedy(PROMPTS[0], 8)
    result = run(
        s.stack.address,
        make_request(prompt_token_ids=PROMPTS[0], max_tokens=8, stop_token_ids=[tokens[2]], **greedy(1.0)),
    )
    last = result.chunks[-1]
    assert result.token_ids[: tokens.index(tokens[2]) + 1] == result.token_ids
    assert last.WhichOneof("stop_reason") == "stop_token_id" and last.stop_token_id == tokens[2]


# --- refused fields and hostile values -----------------------------------------------------------

COMPLETION: dict[str, Any] = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2, "temperature": 0}
CHAT: dict[str, Any] = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("use_beam_search", {"use_beam_search": True}),
    ("watermarking", {"watermarking": True}),
    ("prompt_embeds", {"prompt_embeds": "AAAA"}),
    ("logprob_token_ids", {"logprob_token_ids": [1]}),
    ("kv_transfer_params", {"kv_transfer_params": {"a": 1}}),
    ("ec_transfer_params", {"ec_transfer_params": {"a": 1}}),
    ("vllm_xargs", {"vllm_xargs": {"a": 1}}),
    ("repetition_detection", {"repetition_detection": {"n": 2}}),
    ("priority", {"priority": 1}),
    ("thinking_token_budget", {"thinking_token_budget": 10}),
    ("presence_penalty", {"presence_penalty": 3}),
    ("frequency_penalty", {"frequency_penalty": -3}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("min_p", {"min_p": 2}),
    ("min_tokens", {"min_tokens": 3}),
    ("logit_bias", {"logit_bias": {"1000000": 1}}),
    ("logit_bias", {"logit_bias": {"x": 1}}),
    ("allowed_token_ids", {"allowed_token_ids": []}),
    ("allowed_token_ids", {"allowed_token_ids": [10**6]}),
    ("truncate_prompt_tokens", {"truncate_prompt_tokens": 10**6}),
]
CHAT_REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("reasoning_effort", {"reasoning_effort": "low"}),
    ("chat_template", {"chat_template": "{{ 1 }}"}),
    ("chat_template_kwargs", {"chat_template_kwargs": {"a": 1}}),
    ("mm_processor_kwargs", {"mm_processor_kwargs": {"a": 1}}),
    ("media_io_kwargs", {"media_io_kwargs": {"a": {}}}),
    ("echo", {"echo": True}),
    ("tool_choice", {"tool_choice": "required"}),
    ("continue_final_message", {"continue_final_message": True}),
]
CASES = [("/v1/completions", COMPLETION, *c) for c in REFUSED] + [
    ("/v1/chat/completions", CHAT, *c) for c in REFUSED + CHAT_REFUSED
]


@pytest.mark.parametrize(("path", "base", "field", "extra"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_refused_fields_are_400_naming_them(
    sampling_stack: SamplingStack, path: str, base: dict[str, Any], field: str, extra: dict[str, Any]
) -> None:
    s = sampling_stack
    body = {**base, **extra}
    if field == "min_tokens":
        body["max_tokens"] = 2  # min_tokens above max_tokens
        body.pop("max_completion_tokens", None)
    create = s.client.completions.create if path == "/v1/completions" else s.client.chat.completions.create
    payload = {k: v for k, v in body.items() if k in ("model", "prompt", "messages", "max_tokens")}
    with pytest.raises(openai.BadRequestError) as error:
        create(**payload, extra_body={k: v for k, v in body.items() if k not in payload})  # type: ignore[operator]
    assert error.value.param == field or field in error.value.message, error.value.message  # type: ignore[attr-defined]


def test_implemented_prompt_fields(sampling_stack: SamplingStack) -> None:
    """truncate_prompt_tokens keeps the prompt's last tokens; add_special_tokens, user and priority 0
    are accepted."""
    s = sampling_stack
    prompt = list(range(100, 140))
    fields = {"temperature": 0.0, "repetition_penalty": 1.0}
    got = s.client.completions.create(
        model=MODEL_ID,
        prompt=prompt,
        max_tokens=4,
        user="u",
        extra_body={**fields, "truncate_prompt_tokens": 5},
    )
    assert got.usage is not None and got.usage.prompt_tokens == 5
    expected = run(s.stack.address, make_request(prompt_token_ids=prompt[-5:], max_tokens=4, **fields)).text
    assert got.choices[0].text == expected
    text = "hello world"
    plain = s.tokenizer(text, add_special_tokens=False).input_ids
    got = s.client.completions.create(
        model=MODEL_ID,
        prompt=text,
        max_tokens=2,
        extra_body={**fields, "add_special_tokens": False, "priority": 0},
    )
    assert got.usage is not None and got.usage.prompt_tokens == len(plain)
    named = s.client.completions.create(
        model=MODEL_ID, prompt=text, max_tokens=1, extra_body={**fields, "request_id": "abc123"}
    )
    assert named.id == "cmpl-abc123"


def test_decode_refuses_hostile_history_directly(sampling_stack: SamplingStack) -> None:
    stack = sampling_stack.stack

    async def call(request: decode_pb2.DecodeRequest) -> grpc.StatusCode:
        async with internal_aio_channel(stack.decodes[0].grpc) as channel:
            try:
                async for _ in decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=30):
                    pass
            except grpc.aio.AioRpcError as exc:
                return exc.code()
        return grpc.StatusCode.OK

    def request(ids: list[int], **sampling: Any) -> decode_pb2.DecodeRequest:
        return decode_pb2.DecodeRequest(
            request_id="hostile",
            kv_handle=kv_pb2.KvHandle(num_tokens=3),
            first_token_id=1,
            sampling=sampling_pb2.SamplingParams(max_tokens=4, temperature=0.0, **sampling),
            prompt_token_ids=ids,
        )

    for hostile in (
        request([], repetition_penalty=1.2),
        request([1, 2], presence_penalty=1.0),
        request([1, 2, 10**6], frequency_penalty=1.0),
        request([1, 2, 3], logit_bias={10**6: 1.0}),
        request([1, 2, 3], allowed_token_ids=[-5]),
        request([1, 2, 3], min_tokens=5),
    ):
        assert asyncio.run(call(hostile)) == grpc.StatusCode.INVALID_ARGUMENT, hostile


def test_stop_string_in_the_first_token(sampling_stack: SamplingStack) -> None:
    """The prefill's token alone holds the stop string: the request ends there, its text cut before
    the string, and the string (not the token) is the stop_reason."""
    s = sampling_stack
    first = run(s.stack.address, make_request(prompt_token_ids=PROMPTS[0], max_tokens=1, **greedy(1.0))).text
    stop = first.strip()[-1:]
    assert stop, first
    got = s.client.completions.create(
        model=MODEL_ID, prompt=PROMPTS[0], max_tokens=8, stop=[stop], extra_body=greedy(1.0)
    )
    choice = got.choices[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason) == (
        first[: first.index(stop)],
        "stop",
        stop,
    )  # type: ignore[attr-defined]


def test_a_resumed_request_counts_its_generated_tokens_as_output(sampling_stack: SamplingStack) -> None:
    """A request prefilled again after 5 tokens (as the gateway resumes one whose decode was lost),
    then decoded from that KV, gives the tokens of the undisturbed one-process run: its 5 tokens
    count as output for the penalties and min_tokens, on the prefill and on the decode."""
    s = sampling_stack
    prompt = PROMPTS[0]
    # Negative penalties draw the output's tokens back: with this seed, token 6 repeats token 0,
    # which it would not if the 5 resumed tokens were counted as prompt.
    params = SamplingParams(
        max_tokens=12, temperature=1.0, seed=1, presence_penalty=-2.0, frequency_penalty=-1.0,
        repetition_penalty=1.3, min_tokens=9,
    )  # fmt: skip
    params = sampling_from_proto(sampling_to_proto(params))  # as float32, as the engines see it
    ref = one_process(s, prompt, params)
    assert len(ref) >= 9 and ref[6] in ref[:5], ref
    kv_ids = prompt + ref[:5]

    async def resumed() -> tuple[int, list[int]]:
        async with internal_aio_channel(s.stack.prefills[0].grpc) as channel:
            first = await prefill_pb2_grpc.PrefillStub(channel).Prefill(
                prefill_pb2.PrefillRequest(
                    request_id="resumed",
                    prompt_token_ids=kv_ids,
                    sampling=sampling_to_proto(params),
                    num_generated=5,
                ),
                timeout=60,
            )
        tokens: list[int] = []
        async with internal_aio_channel(s.stack.decodes[0].grpc) as channel:
            request = decode_pb2.DecodeRequest(
                request_id="resumed",
                kv_handle=first.kv_handle,
                first_token_id=first.first_token_id,
                sampling=sampling_to_proto(params),
                num_generated=5,
                prompt_token_ids=kv_ids,
            )
            async for response in decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=60):
                tokens.extend(response.token_ids)
        return first.first_token_id, tokens

    first, rest = asyncio.run(resumed())
    assert [*ref[:5], first, *rest] == ref
