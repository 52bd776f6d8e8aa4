"""StructuredOutput <-> pdserve.v1.StructuredOutput, at the edge of every service."""

from __future__ import annotations

from pdserve.core.structured_output import CHOICE, JSON, JSON_OBJECT, REGEX, StructuredOutput
from pdserve.v1 import sampling_pb2


def structured_from_proto(msg: sampling_pb2.StructuredOutput) -> StructuredOutput:
    """Validates the message's shape and sizes (ValueError names the field); the grammar itself is
    checked by ``pdserve.core.grammar.grammar_of``."""
    kind = msg.WhichOneof("kind")
    any_whitespace = not msg.disable_any_whitespace
    if kind == JSON:
        return StructuredOutput(JSON, msg.json, any_whitespace=any_whitespace)
    if kind == JSON_OBJECT:
        if not msg.json_object:
            raise ValueError("sampling.structured_output.json_object must be true when set")
        return StructuredOutput(JSON_OBJECT, any_whitespace=any_whitespace)
    if kind == REGEX:
        return StructuredOutput(REGEX, msg.regex)
    if kind == CHOICE:
        return StructuredOutput(CHOICE, choices=tuple(msg.choice.choices))
    raise ValueError("sampling.structured_output must set one of json, json_object, regex, choice")


def structured_to_proto(output: StructuredOutput) -> sampling_pb2.StructuredOutput:
    msg = sampling_pb2.StructuredOutput(disable_any_whitespace=not output.any_whitespace)
    if output.kind == JSON:
        msg.json = output.spec
    elif output.kind == JSON_OBJECT:
        msg.json_object = True
    elif output.kind == REGEX:
        msg.regex = output.spec
    else:
        msg.choice.choices.extend(output.choices)
    return msg
