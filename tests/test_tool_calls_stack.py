"""Tool calls through a real stack (gateway, prefill, decode as processes), driven by the official
`openai` client, on tiny-llama (a random model): a named function's call is what its parameters'
schema gives as a structured output, ``required``'s calls are the call array's output, whole or
streamed; a conversation with earlier calls and tool results is served; refused tool choices are 400
naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.conftest import assert_no_leaks
from tests.stack import Stack

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"],
    "additionalProperties": False,
}


def function(name: str, parameters: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "description": f"{name} tool"}}
    if parameters is not None:
        out["function"]["parameters"] = parameters
    return out


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


TOOLS = [function("get_weather", WEATHER), function("get_time", TIME)]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# vLLM's schema of "required" with parallel_tool_calls false, written out.
ONE_CALL = {
    "type": "array",
    "minItems": 1,
    "maxItems": 1,
    "items": {
        "type": "object",
        "anyOf": [
            {
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
            }
            for name, schema in (("get_weather", WEATHER), ("get_time", TIME))
        ],
    },
}


@pytest.fixture(scope="module")
def client(limits_client: openai.OpenAI) -> openai.OpenAI:
    return limits_client


@pytest.fixture(autouse=True)
def nothing_left(limits_stack: Stack) -> Iterator[None]:
    yield
    assert_no_leaks(limits_stack)


def chat(client: openai.OpenAI, extra: dict[str, Any] | None = None, **fields: Any) -> Any:
    fields = {"messages": MESSAGES, "max_tokens": 120, "temperature": 0, **fields}
    return client.chat.completions.create(
        model="tiny-llama", extra_body={**COMPACT, **(extra or {})}, **fields
    )


def test_a_named_call_is_its_parameters_schema_output(client: openai.OpenAI) -> None:
    choice = chat(client, tools=TOOLS, tool_choice=named("get_weather")).choices[0]
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": WEATHER}}
    plain = chat(client, tools=TOOLS, tool_choice="none", response_format=schema).choices[0]
    assert plain.finish_reason == "stop" and plain.message.tool_calls == []
    assert (choice.finish_reason, choice.message.content) == ("stop", "")
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("chatcmpl-tool-") and len(call.id) == len("chatcmpl-tool-") + 32
    assert call.function.arguments == plain.message.content
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_required_calls_are_the_call_arrays_output(client: openai.OpenAI) -> None:
    choice = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False).choices[0]
    plain = chat(client, {"guided_json": ONE_CALL}, tools=TOOLS, tool_choice="none").choices[0]
    [item] = json.loads(plain.message.content)
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", "")
    [call] = choice.message.tool_calls
    assert call.function.name == item["name"]
    assert json.loads(call.function.arguments) == item["parameters"]
    jsonschema.validate(item["parameters"], WEATHER if item["name"] == "get_weather" else TIME)


def test_required_calls_each_get_an_id(client: openai.OpenAI) -> None:
    choice = chat(client, tools=TOOLS, tool_choice="required", max_tokens=300).choices[0]
    if choice.finish_reason == "length":  # the random model went on calling: the text as it stands
        assert choice.message.tool_calls == [] and choice.message.content.startswith("[")
        return
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_a_cut_short_call_array_is_given_as_text(client: openai.OpenAI) -> None:
    choice = chat(client, tools=TOOLS, tool_choice="required", max_tokens=3).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls == []
    assert choice.message.content.startswith("[")


def test_a_streamed_named_call_comes_token_by_token(client: openai.OpenAI) -> None:
    whole = chat(client, tools=TOOLS, tool_choice=named("get_time")).choices[0]
    chunks = list(
        chat(
            client,
            tools=TOOLS,
            tool_choice=named("get_time"),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    parts = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    usage = chunks[-1].usage
    assert usage is not None and len(parts) == usage.completion_tokens  # one chunk per token
    assert parts[0].id and parts[0].function.name == "get_time" and parts[0].type == "function"
    assert all(p.id is None and p.function.name is None and p.index == 0 for p in parts[1:])
    assert "".join(p.function.arguments for p in parts) == whole.message.tool_calls[0].function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_streamed_required_calls_come_whole_at_the_end(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    whole = chat(client, **fields).choices[0]
    chunks = [c for c in chat(client, stream=True, **fields) if c.choices]
    with_calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert len(with_calls) == 1
    [[part]] = with_calls
    [call] = whole.message.tool_calls
    assert (part.index, part.function.name, part.function.arguments) == (
        0,
        call.function.name,
        call.function.arguments,
    )
    assert part.id and part.id != call.id  # each response names its own calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)


def test_n_choices_each_make_their_own_call(client: openai.OpenAI) -> None:
    result = chat(client, tools=TOOLS, tool_choice=named("get_weather"), n=3, temperature=1.0, seed=4)
    assert [c.index for c in result.choices] == [0, 1, 2]
    for choice in result.choices:
        [call] = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_a_conversation_with_calls_and_their_results_is_served(client: openai.OpenAI) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
    ]
    short = chat(client, tools=TOOLS, tool_choice="none", max_tokens=4)
    longer = chat(client, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert longer.usage.prompt_tokens > short.usage.prompt_tokens
    assert longer.choices[0].message.content


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS}, "tool_choice"),  # "auto" by default: no tool-call parser
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": named("nope")}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": [function("a"), function("a")], "tool_choice": "required"}, "tools"),
        ({"tools": [function("a", {"type": 7})], "tool_choice": "required"}, "tools"),
        ({"tools": [function("a", {"type": 7})], "tool_choice": named("a")}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "stream": True, "logprobs": True}, "logprobs"),
    ],
)
def test_refused_tool_choices(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, fields)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]
