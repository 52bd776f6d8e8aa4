"""Generated token ids -> text the client may see: incremental detokenization plus stop strings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class TextChunk:
    token_ids: list[int]
    text: str
    stopped: bool


class TextStream:
    def __init__(
        self, tokenizer: Any, stop: tuple[str, ...], include_stop: bool = False, min_tokens: int = 0
    ) -> None:
        """``include_stop``: the text keeps the stop string; ``min_tokens``: the text of the first
        ``min_tokens`` tokens is not searched for stop strings (as vLLM)."""
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._stops = StopStringMatcher(stop, include_stop)
        self._min_tokens = min_tokens
        self.num_tokens = 0

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, or None."""
        return self._stops.matched

    def add(self, token_ids: list[int]) -> TextChunk:
        """Takes tokens one by one; the chunk ends at (and includes) a token completing a stop string."""
        taken: list[int] = []
        texts: list[str] = []
        for token in token_ids:
            taken.append(token)
            self.num_tokens += 1
            delta = self._detokenizer.add([token])
            if self.num_tokens <= self._min_tokens:
                texts.append(delta)
                continue
            text, stopped = self._stops.feed(delta)
            texts.append(text)
            if stopped:
                return TextChunk(taken, "".join(texts), True)
        return TextChunk(taken, "".join(texts), False)

    def finish(self) -> TextChunk:
        """The text still held back at the end of a stream that did not stop on a stop string."""
        text, stopped = self._stops.feed(self._detokenizer.flush())
        if stopped:
            return TextChunk([], text, True)
        return TextChunk([], text + self._stops.flush(), False)
