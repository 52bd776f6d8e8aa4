"""Tool calls of chat requests, as vLLM serves them without a tool-call parser.

``tools`` are given to the model's chat template (``tools=``), and the conversation may hold the
assistant's earlier ``tool_calls`` (their JSON arguments given to the template as objects, as vLLM
does) and the ``tool`` messages that answer them. ``tool_choice``:

- ``"none"``: the model answers in text (the template still sees the tools);
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is constrained
  to that function's ``parameters`` schema (any JSON object when it has none) and is the one call's
  arguments; the finish reason stays ``stop`` (or ``length``);
- ``"required"``: the output is constrained to a JSON array of one or more ``{"name",
  "parameters"}`` objects, one per call, of the tools given (``parallel_tool_calls: false``: one
  call); each becomes a call, and a choice that ends on its own finishes with ``tool_calls``;
- ``"auto"``, which is also the default with tools, needs a parser of the model's own tool-call
  format, which pdserve does not have: 400, as vLLM answers without ``--enable-auto-tool-choice``.

``structured_outputs.disable_any_whitespace`` applies to the calls' JSON as to any JSON output; any
other constraint beside a tool choice is refused (400).

Each call gets an id ``chatcmpl-tool-<32 hex>``. A whole response gives the calls in
``message.tool_calls`` with empty ``content``. A stream gives a named call's arguments as they come,
one chunk per token (the first with the call's id and name); the calls of ``"required"`` come whole in
one chunk once the choice ends. An output cut by ``max_tokens`` that does not parse as calls is
given as ``content``.
"""

from __future__ import annotations

import copy
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from gateway.openai_errors import bad_request
from gateway.openai_models import ChatCompletionRequest, FinishReason
from gateway.openai_tools import (
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from pdserve.core.grammar import grammar_of
from pdserve.core.structured_output import JSON, StructuredOutput

ANY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


def tool_call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


@dataclass(frozen=True)
class ToolMode:
    """How a request's output becomes tool calls: one named function's, or ``required``'s array."""

    function: str  # the named function ("" for required)
    constraint: StructuredOutput

    @property
    def required(self) -> bool:
        return not self.function

    def calls(self, text: str) -> list[ToolCall] | None:
        """The calls ``text`` makes; None when it is not calls (an output cut short)."""
        if not self.required:
            return [ToolCall(id=tool_call_id(), function=FunctionCall(name=self.function, arguments=text))]
        try:
            items = json.loads(text)
        except ValueError:
            return None
        if not isinstance(items, list) or not items:
            return None
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            arguments = json.dumps(item.get("parameters", {}), ensure_ascii=False)
            calls.append(
                ToolCall(id=tool_call_id(), function=FunctionCall(name=item["name"], arguments=arguments))
            )
        return calls

    def finish(self, reason: FinishReason, calls: list[ToolCall] | None) -> FinishReason:
        return "tool_calls" if self.required and calls and reason == "stop" else reason


def tool_mode(body: ChatCompletionRequest) -> ToolMode | None:
    """The request's tool calling (None: a text answer); OpenAIError (400) naming the field when
    its tools or tool_choice are refused."""
    choice = body.tool_choice
    if not body.tools:
        if choice in (None, "none"):
            return None
        raise bad_request("tool_choice needs tools", "tool_choice")
    _check_names(body.tools)
    if choice == "none":
        return None
    if choice in (None, "auto"):
        raise bad_request(
            'tool_choice "auto" (the default with tools) needs a parser of the model\'s tool-call format, '
            'which pdserve does not have; give tool_choice "required", a named function, or "none"',
            "tool_choice",
        )
    if body.stream and body.logprobs and choice == "required":
        raise bad_request('logprobs are not streamed with tool_choice "required"', "logprobs")
    options = body.structured_outputs
    whitespace = options is None or not options.disable_any_whitespace
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in body.tools if t.function.name == choice.function.name), None)
        if tool is None:
            raise bad_request(
                f"tool_choice names {choice.function.name[:64]!r}, which is not one of the tools",
                "tool_choice",
            )
        return ToolMode(choice.function.name, _constraint(tool.function.parameters or ANY_OBJECT, whitespace))
    return ToolMode("", _constraint(_calls_schema(body.tools, body.parallel_tool_calls), whitespace))


def _check_names(tools: list[ChatTool]) -> None:
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: each function needs a name of its own", "tools")


def _calls_schema(tools: list[ChatTool], parallel: bool | None) -> dict[str, Any]:
    """vLLM's: an array of ``{"name", "parameters"}``, one schema per tool, their ``$defs`` shared."""
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        parameters = copy.deepcopy(tool.function.parameters) or ANY_OBJECT
        for name, definition in (parameters.pop("$defs", None) or {}).items():
            if defs.setdefault(name, definition) != definition:
                raise bad_request(f"tools: the definition {name[:64]!r} has two schemas", "tools")
        options.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _constraint(schema: dict[str, Any], whitespace: bool) -> StructuredOutput:
    try:
        output = StructuredOutput(JSON, json.dumps(schema), any_whitespace=whitespace)
        grammar_of(output)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"tools: {exc}", "tools") from None
    return output


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools as the chat template takes them."""
    return [t.model_dump(exclude_none=True) for t in tools]


def template_call(call: ToolCall) -> dict[str, Any]:
    """An earlier call of the conversation for the chat template: its arguments as an object when
    they are one (templates write them out themselves), else as given."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    if not isinstance(arguments, dict):
        arguments = call.function.arguments
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


@dataclass
class ToolCallStream:
    """The tool calls of a streamed request, choice by choice."""

    mode: ToolMode
    _ids: dict[int, str] = field(default_factory=dict)

    def part(self, index: int, text: str) -> list[DeltaToolCall] | None:
        """A named call's arguments as they come (the first part with its id and name); nothing
        for ``required``, whose calls come whole at the end."""
        if self.mode.required:
            return None
        if index in self._ids:
            return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]
        self._ids[index] = tool_call_id()
        return [
            DeltaToolCall(
                index=0,
                id=self._ids[index],
                type="function",
                function=DeltaFunctionCall(name=self.mode.function, arguments=text),
            )
        ]

    def whole(self, text: str) -> tuple[list[DeltaToolCall] | None, list[ToolCall] | None]:
        """``required``'s calls at a choice's end, as parts and as calls (None when ``text`` is not
        calls, or the mode is a named function's)."""
        if not self.mode.required:
            return None, None
        calls = self.mode.calls(text)
        if calls is None:
            return None, None
        parts = [
            DeltaToolCall(
                index=i,
                id=call.id,
                type="function",
                function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
            )
            for i, call in enumerate(calls)
        ]
        return parts, calls
