"""``--chat-template``: a file holding a Jinja chat template, or the template itself, as vLLM's
flag reads it. A value that names no readable file and holds none of ``{``, ``}`` or a newline is
taken for a file path that failed (an error); otherwise it is the template, with its backslash
escapes (``\\n``) read as escapes. The gateway's tokenizer takes it in place of the model's own, for
chat completions, ``/tokenize`` with messages and the gRPC API's ``apply_chat_template``."""

from __future__ import annotations

import codecs

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str | None:
    """The template ``value`` gives (None for ''); ValueError when it is neither a readable file
    nor a template that compiles."""
    if not value:
        return None
    try:
        with open(value, encoding="utf-8") as file:
            template = file.read()
    except OSError as error:
        if not any(c in value for c in JINJA_CHARS):
            raise ValueError(
                f"chat_template {value!r} looks like a file path, but it cannot be read: {error.strerror}"
            ) from None
        template = codecs.decode(value, "unicode_escape")
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as error:
        raise ValueError(f"chat_template is not a valid Jinja template: {error}") from None
    return template
