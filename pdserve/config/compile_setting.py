"""The ``compile`` setting of an engine (``--compile``): auto, true or false.

``auto`` compiles where compiling measured faster (``pdserve.model.compile_choice``); a bare
``--compile`` is ``true``. The boolean spellings the other flags take (1/0, yes/no, on/off) are
accepted and read as true or false.
"""

from __future__ import annotations

COMPILE_CHOICES = ("auto", "true", "false")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def compile_setting(value: object) -> str:
    """``value`` as one of ``COMPILE_CHOICES``; ValueError naming it otherwise."""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value).strip().lower()
    if text in _TRUE:
        return "true"
    if text in _FALSE:
        return "false"
    if text == "auto":
        return "auto"
    raise ValueError(f"compile must be one of {', '.join(COMPILE_CHOICES)} (or a boolean), got {value!r}")
