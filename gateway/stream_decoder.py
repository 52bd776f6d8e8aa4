"""Incremental decoding by tokenizers' ``DecodeStream``: the per-request state lives in Rust and
each token costs one decode of a window of a few tokens.

The stream gives text out once it no longer ends in an unfinished character (U+FFFD), so a
character split across tokens goes out whole with the token completing it. What the stream holds
at the end is given by ``flush``. When a token makes the decode of the window rewrite text already
given out (byte-fallback tokenizers turn a run of byte tokens with an invalid byte into one U+FFFD
per byte), the stream cannot go on: the rest is decoded by windows (``gateway.window_decoder``)
from where it stood.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from gateway.window_decoder import WindowDecoder

INVALID_PREFIX = "Invalid prefix"


class StreamDecoder:
    def __init__(self, backend: Tokenizer, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._done: list[int] = []  # the tokens of the last text given out (the window's context)
        self._held: list[int] = []  # tokens since, whose text the stream holds
        self._fallback: WindowDecoder | None = None

    def add(self, token_ids: Sequence[int]) -> str:
        """The text ``token_ids`` make final (possibly empty)."""
        return "".join(self._step(token) for token in token_ids)

    def flush(self) -> str:
        """The text still held (an unfinished character decodes as U+FFFD); the decoder is then empty."""
        if self._fallback is not None:
            return self._fallback.flush()
        if not self._held:
            return ""
        context = self._decode(self._done)
        text = self._decode(self._done + self._held)
        self._done, self._held = [], []
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        return text[len(context) :]

    def _step(self, token: int) -> str:
        if self._fallback is not None:
            return self._fallback.add([token])
        try:
            text = self._stream.step(self._backend, token)
        except Exception as exc:  # tokenizers raises a plain Exception
            if INVALID_PREFIX not in str(exc):
                raise
            self._fallback = WindowDecoder.resume(self._decode, self._done, self._held)
            return self._fallback.add([token])
        if text is None:
            self._held.append(token)
            return ""
        self._done = [*self._held, token]
        self._held = []
        return str(text)

    def _decode(self, token_ids: list[int]) -> str:
        return str(self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens))
