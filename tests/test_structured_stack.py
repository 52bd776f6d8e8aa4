"""Structured output through a real stack (gateway, prefill, decode as processes), driven by the
official `openai` client and the gRPC API, on tiny-llama (a random model: its free output is not JSON):
json_object and json_schema outputs parse and validate, regex and choice outputs match, greedy and
seeded, streamed or not; max_tokens=1 is masked on the prefill; a resumed request (the migration
path: prefill with the tokens so far, then decode from them) continues the grammar exactly; bad
specs are 400 / INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from pdserve.core.grammar import Grammars
from pdserve.core.structured_output import StructuredOutput
from pdserve.rpc.structured_output_proto import structured_to_proto
from pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from tests.conftest import assert_no_leaks
from tests.grpc_client import make_request, run
from tests.stack import Stack, internal_channel
from tests.test_structured_output import one_process

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["small", "large"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "size", "n"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
CHOICES = ["The capital of France is Paris.", "Once upon a time there was a little robot"]
REGEX = r"[a-z]{2,8}-[0-9]{2}"
MESSAGES = [{"role": "user", "content": "Describe an item."}]


@pytest.fixture(scope="module")
def stack(limits_stack: Stack) -> Stack:
    """tiny-llama with HTTP on, shared with the input-limit tests."""
    return limits_stack


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    assert stack.gateway is not None
    return openai.OpenAI(base_url=f"http://{stack.gateway.ready['http']}/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "stack" in request.fixturenames:
        assert_no_leaks(request.getfixturevalue("stack"))


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(model="tiny-llama", messages=MESSAGES, **fields).choices[0]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}])
def test_json_schema_output_validates(client: openai.OpenAI, sampling: dict[str, Any]) -> None:
    free = chat(client, max_tokens=30, **sampling)
    with pytest.raises(ValueError):
        json.loads(free.message.content)  # the model's own output is not JSON
    choice = chat(client, max_tokens=60, response_format=JSON_SCHEMA, extra_body=COMPACT, **sampling)
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    again = chat(client, max_tokens=60, response_format=JSON_SCHEMA, extra_body=COMPACT, **sampling)
    assert again.message.content == choice.message.content


def test_json_object_output_parses(client: openai.OpenAI) -> None:
    choice = client.completions.create(
        model="tiny-llama",
        prompt="def add(a, b):",
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    ).choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.text), dict)


def test_streamed_json_schema_output_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=MESSAGES,
        max_tokens=60,
        temperature=1.0,
        seed=3,
        response_format=JSON_SCHEMA,  # type: ignore[arg-type]
        extra_body=COMPACT,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 2
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_and_choice_outputs_match(client: openai.OpenAI) -> None:
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        regex = client.completions.create(
            model="tiny-llama",
            prompt="The quick brown fox",
            max_tokens=30,
            extra_body={"structured_outputs": {"regex": REGEX}},
            **sampling,  # type: ignore[arg-type]
        ).choices[0]
        assert regex.finish_reason == "stop" and re.fullmatch(REGEX, regex.text), regex.text
        picked = chat(client, max_tokens=40, extra_body={"guided_choice": CHOICES}, **sampling)
        assert picked.finish_reason == "stop" and picked.message.content in CHOICES


def test_max_tokens_1_is_masked_on_the_prefill(client: openai.OpenAI) -> None:
    choice = chat(client, max_tokens=1, temperature=0, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert choice.finish_reason == "length"
    assert choice.message.content and any(c.startswith(choice.message.content) for c in CHOICES)


def test_grpc_api_takes_a_structured_output(stack: Stack) -> None:
    result = run(
        stack.address,
        make_request(
            prompt="Water boils at",
            max_tokens=30,
            temperature=0.0,
            structured_output=sampling_pb2.StructuredOutput(regex=REGEX),
        ),
    )
    assert result.finish_reason == "stop" and re.fullmatch(REGEX, result.text), result.text
    with pytest.raises(grpc.RpcError) as info:
        run(
            stack.address,
            make_request(prompt="x", structured_output=sampling_pb2.StructuredOutput(regex="([")),
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output.regex" in (info.value.details() or "")


def test_resumed_request_continues_the_grammar(stack: Stack, reference_models: Any) -> None:
    """The migration path: the prefill of the prompt and the tokens so far, then the decode from
    them, give the tokens of one undisturbed constrained run."""
    model, tokenizer = reference_models("tiny-llama")
    output = StructuredOutput("json", json.dumps(SCHEMA), any_whitespace=False)
    grammars = Grammars(tokenizer, model.config.vocab_size, {tokenizer.eos_token_id})
    prompt = tokenizer.encode("Water boils at", add_special_tokens=False)
    expected = one_process(SimpleNamespace(model=model), grammars, output, prompt, 60)  # type: ignore[arg-type]
    k = 4
    sampling = sampling_pb2.SamplingParams(
        max_tokens=60, temperature=0.0, structured_output=structured_to_proto(output)
    )
    with internal_channel(stack.prefills[0].grpc) as channel:
        prefill = prefill_pb2_grpc.PrefillStub(channel)
        with pytest.raises(grpc.RpcError) as info:  # tokens the grammar cannot have generated
            prefill.Prefill(
                prefill_pb2.PrefillRequest(
                    prompt_token_ids=[*prompt, 5, 6], sampling=sampling, num_generated=2
                )
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        first = prefill.Prefill(
            prefill_pb2.PrefillRequest(
                prompt_token_ids=prompt + expected[:k], sampling=sampling, num_generated=k
            )
        )
    assert first.first_token_id == expected[k]
    request = decode_pb2.DecodeRequest(
        kv_handle=first.kv_handle, first_token_id=first.first_token_id, sampling=sampling, num_generated=k
    )
    with internal_channel(stack.decodes[0].grpc) as channel:
        decode = decode_pb2_grpc.DecodeStub(channel)
        with pytest.raises(grpc.RpcError) as info:  # the grammar's state needs the tokens before
            list(decode.Decode(request))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "generated_token_ids" in (info.value.details() or "")
        request.generated_token_ids.extend(expected[:k])
        responses = list(decode.Decode(request))
    assert [first.first_token_id, *(t for r in responses for t in r.token_ids)] == expected[k:]
    assert responses[-1].finish_reason == "stop"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_json": '{"type": "object"', "response_format": {"type": "json_object"}}, "guided_json"),
        ({"guided_grammar": "start: 'a'"}, "guided_grammar"),
        ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format"),
        ({"structured_outputs": {"regex": "a" * 70000}}, "structured_outputs"),
        ({"structured_outputs": {"json": '{"items": ' * 3000 + "{}" + "}" * 3000}}, "structured_outputs"),
    ],
)
def test_bad_specs_are_refused(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=4, extra_body=fields)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]
