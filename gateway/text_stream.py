"""Generated token ids -> text the client may see: incremental detokenization plus stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop_strings import StopStringMatcher
from pdserve.core.sampling import SamplingParams


@dataclass(frozen=True)
class TextChunk:
    token_ids: list[int]
    text: str
    stopped: bool


class TextStream:
    """The text of one request's tokens: decoded after ``prompt_ids`` (the prompt's end gives the
    first token its context), with the request's special-token options and stop strings
    (``include_stop_str_in_output``: the text keeps the stop string; the text of the first
    ``min_tokens`` tokens is not searched for stop strings, as vLLM)."""

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_ids: Sequence[int] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        self._stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self._min_tokens = params.min_tokens
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
