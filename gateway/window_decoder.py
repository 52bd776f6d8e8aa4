"""Incremental decoding by windows of ``decode``: each token's text is what it adds to the decode of
the tokens before it, over a window that stays a few tokens long.

Each step decodes only ``ids[prefix_offset:]`` and compares it with the decoded
``ids[prefix_offset:read_offset]``, so the cost per step is bounded by the window, not by the length
of the stream. The tokens before the new ones stay in the window, so that tokenizers whose decode of
a first token differs (SentencePiece drops its leading space) give the text those tokens have in
context. An unfinished multi-byte character at the end of the window decodes as U+FFFD; it is held
until the tokens that complete it arrive, and the characters before it go out at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHAR = "\ufffd"

Decode = Callable[[list[int]], str]


class WindowDecoder:
    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._emitted = 0

    @classmethod
    def resume(cls, decode: Decode, done: Sequence[int], held: Sequence[int]) -> WindowDecoder:
        """A decoder that goes on after ``done`` (tokens whose text was given out, the window's
        context) and ``held`` (tokens after them whose text was not)."""
        decoder = cls(decode)
        decoder._ids = [*done, *held]
        decoder._read_offset = len(done)
        decoder._prefix_text = decode(list(done))
        return decoder

    def add(self, token_ids: Sequence[int]) -> str:
        """The text ``token_ids`` make final (possibly empty)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        new_text = self._decode(self._ids[self._prefix_offset :])
        done = len(self._prefix_text) + self._emitted
        if new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text.rstrip(REPLACEMENT_CHAR)[done:]
            self._emitted += len(delta)
        elif len(new_text) > done:
            delta = new_text[done:]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            self._emitted = 0
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        else:
            delta = ""
        return delta

    def flush(self) -> str:
        """The text still held (an unfinished character decodes as U+FFFD); the decoder is then empty."""
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(self._prefix_text) + self._emitted :]
        self._ids = []
        self._prefix_offset = self._read_offset = 0
        self._prefix_text = ""
        self._emitted = 0
        return delta
