"""The structured output of an HTTP request: its ``response_format``, ``structured_outputs`` and
``guided_*`` fields as one ``StructuredOutput``.

As in vLLM, ``response_format`` (``json_object``, ``json_schema``) takes the options of
``structured_outputs`` (``disable_any_whitespace``). ``json``, ``json_object``, ``regex`` and
``choice`` are served; ``grammar``, ``structural_tag``, ``whitespace_pattern`` and
``disable_additional_properties`` are refused with 400 naming the field, as is a request giving two
constraints or one that is not valid.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.openai_errors import bad_request
from gateway.openai_structured import StructuredFields, StructuredOutputs
from pdserve.core.grammar import grammar_of
from pdserve.core.structured_output import CHOICE, JSON, JSON_OBJECT, REGEX, StructuredOutput


def structured_output(body: StructuredFields) -> StructuredOutput | None:
    """The request's constraint, validated and compiled once; OpenAIError (400) naming the
    field when it is refused or not valid."""
    found = _constraints(body)
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"give one structured output constraint, got {names}", found[1][0].split(".")[0])
    field, output = found[0]
    try:
        grammar_of(output)
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", field.split(".")[0]) from None
    return output


def _constraints(body: StructuredFields) -> list[tuple[str, StructuredOutput]]:
    options = body.structured_outputs or StructuredOutputs()
    for name in ("grammar", "structural_tag", "whitespace_pattern"):
        if getattr(options, name) is not None:
            raise bad_request(f"structured_outputs.{name} is not supported", "structured_outputs")
    if options.disable_additional_properties:
        raise bad_request(
            "structured_outputs.disable_additional_properties is not supported", "structured_outputs"
        )
    for name in ("guided_grammar", "guided_whitespace_pattern"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name} is not supported", name)
    whitespace = not options.disable_any_whitespace
    found: list[tuple[str, StructuredOutput]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "structural_tag":
        raise bad_request("response_format of type structural_tag is not supported", "response_format")
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", _made("response_format", JSON_OBJECT, whitespace=whitespace)))
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format")
        schema = _schema_text("response_format", fmt.json_schema.json_schema)
        found.append(("response_format", _made("response_format", JSON, schema, whitespace=whitespace)))
    for field, value in (("structured_outputs.json", options.json_), ("guided_json", body.guided_json)):
        if value is not None:
            found.append((field, _made(field, JSON, _schema_text(field, value), whitespace=whitespace)))
    if options.json_object:
        found.append(
            (
                "structured_outputs.json_object",
                _made("structured_outputs", JSON_OBJECT, whitespace=whitespace),
            )
        )
    for field, pattern in (
        ("structured_outputs.regex", options.regex),
        ("guided_regex", body.guided_regex),
    ):
        if pattern is not None:
            found.append((field, _made(field, REGEX, pattern)))
    for field, choices in (
        ("structured_outputs.choice", options.choice),
        ("guided_choice", body.guided_choice),
    ):
        if choices is not None:
            found.append((field, _made(field, CHOICE, choices=tuple(choices))))
    return found


def _schema_text(field: str, schema: str | dict[str, Any] | bool) -> str:
    if isinstance(schema, str):
        return schema
    try:
        return json.dumps(schema)
    except (ValueError, RecursionError):
        raise bad_request(f"{field}: the schema is not valid JSON", field.split(".", maxsplit=1)[0]) from None


def _made(
    field: str, kind: str, spec: str = "", choices: tuple[str, ...] = (), whitespace: bool = True
) -> StructuredOutput:
    try:
        return StructuredOutput(kind, spec, choices, any_whitespace=whitespace)
    except ValueError as exc:
        raise bad_request(f"{field}: {exc}", field.split(".", maxsplit=1)[0]) from None
