"""Tool calls one part at a time: a choice's output as calls, the finish reason, the call array's
schema (vLLM's), refused tools, and the conversation's tools, calls and results as the chat
template gets them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.openai_errors import OpenAIError
from gateway.openai_models import ChatCompletionRequest
from gateway.openai_requests import ChatPrompt
from gateway.tokenize_api import TokenizeRequest
from gateway.tool_calls import ToolCallStream, tool_mode
from pdserve.model.source import resolve_model_dir

OBJ = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}


def request(**fields: Any) -> ChatCompletionRequest:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def tool(name: str, parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def test_required_output_is_each_call_with_its_own_id() -> None:
    mode = tool_mode(request(tools=[tool("a", OBJ), tool("b")], tool_choice="required"))
    assert mode is not None and mode.required
    text = json.dumps([{"name": "a", "parameters": {"q": "été"}}, {"name": "b", "parameters": {}}])
    calls = mode.calls(text)
    assert calls is not None
    assert [(c.function.name, c.function.arguments) for c in calls] == [("a", '{"q": "été"}'), ("b", "{}")]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert mode.finish("stop", calls) == "tool_calls"
    assert mode.finish("length", calls) == "length"
    for not_calls in ('[{"name": "a", "parameters": {', "[]", '{"name": "a"}', "[1]", '[{"parameters": {}}]'):
        assert mode.calls(not_calls) is None, not_calls
        assert mode.finish("stop", mode.calls(not_calls)) == "stop"


def test_a_named_functions_output_is_its_arguments() -> None:
    mode = tool_mode(request(tools=[tool("a", OBJ), tool("b")], tool_choice=named("b")))
    assert mode is not None and not mode.required
    assert json.loads(mode.constraint.spec) == {
        "type": "object",
        "properties": {},
    }  # no parameters: any object
    calls = mode.calls('{"x": 1')
    assert calls is not None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("b", '{"x": 1')
    ]
    assert mode.finish("stop", calls) == "stop"


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def test_the_call_array_schema_is_vllms() -> None:
    defs_a = {**OBJ, "$defs": {"D": {"type": "integer"}}}
    defs_b = {"type": "object", "$defs": {"D": {"type": "integer"}}}
    mode = tool_mode(
        request(
            tools=[tool("a", defs_a), tool("b", defs_b)], tool_choice="required", parallel_tool_calls=False
        )
    )
    assert mode is not None
    schema = json.loads(mode.constraint.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["$defs"] == {"D": {"type": "integer"}}
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"] for o in options] == [
        {"type": "string", "enum": ["a"]},
        {"type": "string", "enum": ["b"]},
    ]
    assert options[0]["properties"]["parameters"] == OBJ and all(
        o["required"] == ["name", "parameters"] for o in options
    )
    assert "$defs" in defs_a  # the request's own schema is left as it was
    unbounded = tool_mode(request(tools=[tool("a")], tool_choice="required"))
    assert unbounded is not None and "maxItems" not in json.loads(unbounded.constraint.spec)
    compact = tool_mode(
        request(
            tools=[tool("a")], tool_choice="required", structured_outputs={"disable_any_whitespace": True}
        )
    )
    assert (
        compact is not None and not compact.constraint.any_whitespace and unbounded.constraint.any_whitespace
    )


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {
                "tools": [tool("a", {"$defs": {"D": {"type": "string"}}}), tool("b", {"$defs": {"D": {}}})],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": [tool("a"), tool("a")], "tool_choice": "none"}, "tools"),
        ({"tools": [tool("a")]}, "tool_choice"),
        ({"tool_choice": named("a")}, "tool_choice"),
    ],
)
def test_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        tool_mode(request(**fields))
    assert (info.value.status, info.value.info.param) == (400, param)


def test_no_tools_or_none_is_a_text_answer() -> None:
    assert tool_mode(request()) is None
    assert tool_mode(request(tool_choice="none")) is None
    assert tool_mode(request(tools=[tool("a")], tool_choice="none")) is None


def test_a_named_call_streams_its_id_and_name_first_per_choice() -> None:
    mode = tool_mode(request(tools=[tool("a")], tool_choice=named("a")))
    assert mode is not None
    stream = ToolCallStream(mode)
    first0, first1, second0 = stream.part(0, "{"), stream.part(1, "{"), stream.part(0, "}")
    assert first0 is not None and first1 is not None and second0 is not None
    assert first0[0].id and first1[0].id and first0[0].id != first1[0].id
    assert (first0[0].function.name, second0[0].id, second0[0].function.name) == ("a", None, None)
    assert stream.whole("{}") == (None, None)


TEMPLATE = (
    "{% for t in tools or [] %}TOOL {{ t.function.name }}|{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
    "{% if m.tool_call_id %}FOR {{ m.tool_call_id }}{% endif %}{% endfor %}"
)


def test_the_template_gets_the_tools_calls_and_results(cache_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("tiny-llama", cache_dir))
    tokenizer.chat_template = TEMPLATE
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}
    body = request(
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "cold"},
        ],
        tools=[tool("w", OBJ), tool("t")],
        tool_choice="none",
    )
    ids = ChatPrompt(tokenizer).token_ids(body.messages, body, body.add_special_tokens)
    text = tokenizer.decode(ids)
    assert "TOOL w|TOOL t|" in text
    assert "CALL c1 w Oslo" in text  # arguments given to the template as an object
    assert "<tool>coldFOR c1" in text
    tokenize = TokenizeRequest.model_validate(
        {"messages": body.model_dump()["messages"], "tools": body.tools}
    )
    assert ChatPrompt(tokenizer).token_ids(tokenize.messages or [], tokenize) == ids  # /tokenize's
