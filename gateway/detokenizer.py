"""Incremental detokenization: a stream of generated token ids to text deltas, seeded with the end of
the prompt.

The text of a stream is what the prompt and the generated tokens decode to past the prompt's own
text: ``decode(prompt + output)[len(decode(prompt)):]``, a character split between the prompt's
last tokens and the first generated ones belonging to the output. The stream starts from the last
few tokens of the prompt (``prompt_tail``) and drops their text, so the first generated token
decodes in its context: after a prompt, a SentencePiece (Metaspace) ``▁Paris`` is `` Paris``.
An unfinished multi-byte character is held until the token completing it arrives; ``flush`` gives
out what is still held at the end (an unfinished character as U+FFFD).

The equality holds whenever no token rewrites text decoded before it. The one case where a token
does: a byte-fallback tokenizer decodes a run of byte tokens holding an invalid byte as one U+FFFD
per byte, so a stray continuation byte after a complete character turns that character into U+FFFDs.
The stream keeps what it gave out and goes on from there.

Two decoders give the same text (``decoder_for``): tokenizers' ``DecodeStream`` over a fast
tokenizer's backend (``gateway.stream_decoder``) when ``tokenizer.decode`` is the backend's decode
(no text clean-up), and windows of ``tokenizer.decode`` (``gateway.window_decoder``) otherwise.

``skip_special_tokens`` drops special tokens from the text, as ``decode`` does.
``spaces_between_special_tokens`` off (with special tokens kept) gives an added token that follows
another one as its bare content, as vLLM does for fast tokenizers (whose ``decode`` takes no such
option); a slow tokenizer gets it as ``decode``'s own option.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from gateway.stream_decoder import StreamDecoder
from gateway.window_decoder import REPLACEMENT_CHAR, WindowDecoder

MIN_TAIL = 4  # prompt tokens the stream starts from, at least
MAX_TAIL = 32  # and at most


class Decoder(Protocol):
    def add(self, token_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas (``add``), then ``flush`` at the end of the stream.

    ``use_decode_stream``: None picks by tokenizer (``decode_stream_fits``); False forces the
    windowed decode (True forces the stream, for tests: a tokenizer it does not fit is refused).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        use_decode_stream: bool | None = None,
    ) -> None:
        fits = decode_stream_fits(tokenizer)
        if use_decode_stream and not fits:
            raise ValueError("this tokenizer's decode is not its backend's: DecodeStream does not fit it")
        stream = fits if use_decode_stream is None else use_decode_stream
        decode = decode_function(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._decoder: Decoder = (
            StreamDecoder(tokenizer.backend_tokenizer, skip_special_tokens)
            if stream
            else WindowDecoder(decode)
        )
        self.uses_decode_stream = stream
        tail = prompt_tail(prompt_ids, decode)
        for token in tail:  # one at a time: a split last character stays held
            self._decoder.add([token])
        # An unfinished character at the prompt's end that the output does not complete is the
        # prompt's U+FFFD (decode(prompt) ends with it): the stream does not give it out again.
        tail_text = decode(tail)
        self._prompt_replacements = len(tail_text) - len(tail_text.rstrip(REPLACEMENT_CHAR))
        self._bare_tokens: Mapping[int, str] = {}
        fast = isinstance(tokenizer, PreTrainedTokenizerFast)
        if not skip_special_tokens and not spaces_between_special_tokens and fast:
            self._bare_tokens = added_tokens(tokenizer.backend_tokenizer)
        self._last_added = False
        self._ids: list[int] = []
        self._parts: list[str] = []
        self._finished = False

    @property
    def text(self) -> str:
        """All text returned by ``add`` and ``flush`` so far."""
        return "".join(self._parts)

    @property
    def token_ids(self) -> list[int]:
        """A copy of all generated token ids added so far."""
        return list(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text they make final (possibly empty)."""
        if self._finished:
            raise RuntimeError("add() called after flush(); the stream is finished")
        texts = []
        for token in token_ids:
            self._ids.append(token)
            text = self._decoder.add([token])
            bare = self._bare_tokens.get(token)
            if bare is not None and self._last_added:
                text = bare
            self._last_added = bare is not None
            texts.append(text)
        delta = self._past_prompt("".join(texts))
        if delta:
            self._parts.append(delta)
        return delta

    def _past_prompt(self, delta: str) -> str:
        """``delta`` without the U+FFFD of the prompt's unfinished last character, when the first
        text the decoder gives starts with it (the output did not complete that character)."""
        if not self._prompt_replacements or not delta:
            return delta
        held = self._prompt_replacements
        self._prompt_replacements = 0
        leading = len(delta) - len(delta.lstrip(REPLACEMENT_CHAR))
        return delta[min(held, leading) :]

    def flush(self) -> str:
        """Return the text still held (an unfinished character as U+FFFD) and end the stream."""
        if self._finished:
            return ""
        self._finished = True
        delta = self._past_prompt(self._decoder.flush())
        if delta:
            self._parts.append(delta)
        return delta


def decode_stream_fits(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` is its backend's decode, which ``DecodeStream`` steps through."""
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and type(tokenizer)._decode is PreTrainedTokenizerFast._decode
        and isinstance(getattr(tokenizer, "backend_tokenizer", None), Tokenizer)
        and not tokenizer.clean_up_tokenization_spaces
    )


def decode_function(
    tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` with the stream's options (a fast tokenizer takes no spacing option)."""
    options: dict[str, bool] = {"skip_special_tokens": skip_special_tokens}
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        options["spaces_between_special_tokens"] = spaces_between_special_tokens

    def decode(token_ids: list[int]) -> str:
        return str(tokenizer.decode(token_ids, **options))

    return decode


def prompt_tail(prompt_ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[int]:
    """The end of the prompt the stream starts from: the shortest one of at least MIN_TAIL tokens
    that decodes to some text with no U+FFFD before its end (a split last character is fine: the
    output completes it), else the last MAX_TAIL tokens."""
    ids = list(prompt_ids)
    for size in range(min(MIN_TAIL, len(ids)), min(MAX_TAIL, len(ids)) + 1):
        text = decode(ids[len(ids) - size :]).rstrip(REPLACEMENT_CHAR)
        if text and REPLACEMENT_CHAR not in text:
            return ids[len(ids) - size :]
    return ids[-MAX_TAIL:]


def added_tokens(backend: Tokenizer) -> dict[int, str]:
    """Every added token of ``backend`` (special or not): id -> content."""
    return {token_id: token.content for token_id, token in backend.get_added_tokens_decoder().items()}
