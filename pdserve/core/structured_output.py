"""What a request's output must match: a JSON schema, any JSON object, a regex or one of a list
of strings (vLLM's ``structured_outputs``; OpenAI's ``response_format``).

A ``StructuredOutput`` is plain data, bounded in size when it is made; ``pdserve.core.grammar``
compiles it into the grammar that masks the tokens of each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

JSON: Final = "json"
JSON_OBJECT: Final = "json_object"
REGEX: Final = "regex"
CHOICE: Final = "choice"
KINDS: Final = (JSON, JSON_OBJECT, REGEX, CHOICE)

MAX_SPEC_BYTES: Final = 65536  # a schema's JSON text, a regex, or the choices together (UTF-8)
MAX_CHOICES: Final = 256


@dataclass(frozen=True)
class StructuredOutput:
    """``kind`` is one of ``KINDS``; ``spec`` is the schema as JSON text (``json``) or the regex
    (``regex``), empty otherwise; ``choices`` are the strings of ``choice``. ``any_whitespace``:
    JSON may hold any whitespace between its tokens (else none)."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_output must be one of {', '.join(KINDS)}, got {self.kind!r}")
        field = f"structured_output.{self.kind}"
        if self.kind in (JSON, REGEX) and not self.spec:
            raise ValueError(f"{field} must not be empty")
        if self.kind not in (JSON, REGEX) and self.spec:
            raise ValueError(f"{field} takes no spec")
        if self.kind == CHOICE:
            if not self.choices:
                raise ValueError(f"{field} must list at least one string")
            if len(self.choices) > MAX_CHOICES:
                raise ValueError(
                    f"{field} has {len(self.choices)} strings; at most {MAX_CHOICES} are allowed"
                )
        elif self.choices:
            raise ValueError(f"{field} takes no choices")
        size = _utf8_size(field, self.spec) + sum(_utf8_size(field, c) for c in self.choices)
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"{field} is longer than {MAX_SPEC_BYTES} bytes")


def _utf8_size(field: str, text: str) -> int:
    if len(text) > MAX_SPEC_BYTES:  # characters: a lower bound of the bytes, checked before encoding
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{field} is not valid Unicode text (it holds a lone surrogate)") from None
