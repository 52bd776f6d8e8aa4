"""Incremental detokenization: a stream of generated token ids to final text deltas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """The one tokenizer method the detokenizer needs (a transformers tokenizer fits)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, holding back incomplete characters.

    Each step decodes only the window ``ids[prefix_offset:]`` and compares it with the decoded
    ``ids[prefix_offset:read_offset]``, so the cost per step is bounded by the window, not by the
    length of the stream. Keeping the token before the new ones in the window lets tokenizers that
    drop the leading space of the first decoded token (SentencePiece) produce the right spaces. An
    unfinished multi-byte character at the end of the window decodes as U+FFFD; it is held until
    the tokens that complete it arrive.
    """

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._emitted = 0
        self._parts: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """All text returned by ``add`` and ``flush`` so far."""
        return "".join(self._parts)

    @property
    def token_ids(self) -> list[int]:
        """A copy of all token ids added so far."""
        return list(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text they make final (possibly empty).

        Characters before an unfinished one are final and are returned at once; the unfinished
        character (decoded as trailing U+FFFD) is held until a later token completes it.
        """
        if self._finished:
            raise RuntimeError("add() called after flush(); the stream is finished")
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
        else:
            delta = ""
        if delta:
            self._parts.append(delta)
        return delta

    def flush(self) -> str:
        """Return the text still held (an unfinished character decodes as U+FFFD) and end the stream."""
        if self._finished:
            return ""
        self._finished = True
        if self._read_offset == len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(self._prefix_text) + self._emitted :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        self._emitted = 0
        if delta:
            self._parts.append(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
