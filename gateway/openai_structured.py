"""The request fields of structured output in the HTTP API: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` (and its older ``guided_*`` fields); ``gateway.structured_request`` makes
them one ``StructuredOutput``.

As in vLLM, ``response_format`` (``json_object``, ``json_schema``) takes the options of
``structured_outputs`` (``disable_any_whitespace``). ``json``, ``json_object``, ``regex`` and ``choice`` are
served; ``grammar``, ``structural_tag``, ``whitespace_pattern`` and ``disable_additional_properties``
are refused with 400 naming the field, as is a request giving two constraints or an invalid one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one constraint, and its options."""

    model_config = ConfigDict(extra="ignore")

    json_: str | dict[str, Any] | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None


class StructuredFields(BaseModel):
    """The request fields that constrain the output (shared by completions and chat)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
