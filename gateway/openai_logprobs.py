"""Logprobs of the HTTP API, as vLLM's OpenAI server asks for and renders them.

Requests. Completions take ``logprobs: int`` (how many most likely tokens each position lists
besides its own token), ``echo`` (the prompt before the completion; with ``logprobs``, the prompt's
logprobs too, ``prompt_logprobs`` defaulting to ``logprobs``) and vLLM's ``prompt_logprobs: int``;
chat takes ``logprobs: bool``, ``top_logprobs: int`` and ``prompt_logprobs``. A count of -1 is the whole vocabulary. A
count beyond ``--max-logprobs`` (-1: no bound but the vocabulary) is 400 naming the field, as is a
negative one, ``top_logprobs`` without ``logprobs``, and ``prompt_logprobs`` on a stream.

Rendering. Each position's tokens are its own token first, then the most likely ones (without
repeating it), as vLLM's engine lists them: a completion position shows ``logprobs`` + 1 of them
at most (``top_logprobs``, keyed by token text), a chat position the first ``top_logprobs``. Token
text is the token decoded alone (``token_id:N`` with ``return_tokens_as_token_ids``), ``bytes`` its
UTF-8, a logprob of -inf is -9999.0. ``text_offset`` counts the token texts' lengths from the
start of the text (of the streamed completion text before the chunk, on a stream). The
``prompt_logprobs`` of a whole response (vLLM's field: on the completion's choice, on the chat
response) lists ``null`` for the first prompt token, then ``{token_id: {logprob, rank,
decoded_token}}`` per prompt token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from gateway.openai_errors import bad_request
from gateway.openai_models import (
    ChatCompletionRequest,
    ChatLogprob,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    PromptLogprob,
)
from pdserve.v1 import sampling_pb2

MIN_LOGPROB = -9999.0
ALL = -1  # a count meaning the whole vocabulary

Entry = sampling_pb2.TokenLogprobs


def _count(value: int, vocab_size: int) -> int:
    return vocab_size if value == ALL else value


def _check_bound(kind: str, param: str, count: int, max_logprobs: int, vocab_size: int) -> None:
    bound = vocab_size if max_logprobs == ALL else max_logprobs
    if count > bound:
        raise bad_request(
            f"Requested {kind} logprobs of {count}, which is greater than max allowed: {bound}", param
        )


def _check_sign(param: str, value: int | None) -> None:
    if value is not None and value < 0 and value != ALL:
        raise bad_request(f"`{param}` must be a positive value or -1, got {value}", param)


def completion_counts(
    body: CompletionRequest, vocab_size: int, max_logprobs: int
) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) of a completion request, for its SamplingParams."""
    _check_sign("logprobs", body.logprobs)
    _check_sign("prompt_logprobs", body.prompt_logprobs)
    if body.stream and body.prompt_logprobs is not None and body.prompt_logprobs != 0:
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    logprobs = None if body.logprobs is None else _count(body.logprobs, vocab_size)
    prompt = None if body.prompt_logprobs is None else _count(body.prompt_logprobs, vocab_size)
    if prompt is None and body.echo:
        prompt = logprobs
    if logprobs is not None:
        _check_bound("sample", "logprobs", logprobs, max_logprobs, vocab_size)
    if prompt is not None:
        _check_bound("prompt", "prompt_logprobs", prompt, max_logprobs, vocab_size)
    return logprobs, prompt


def chat_counts(
    body: ChatCompletionRequest, vocab_size: int, max_logprobs: int
) -> tuple[int | None, int | None]:
    """(logprobs, prompt_logprobs) of a chat request, for its SamplingParams (None: none)."""
    top = body.top_logprobs
    _check_sign("top_logprobs", top)
    _check_sign("prompt_logprobs", body.prompt_logprobs)
    if top is not None and top != 0 and not body.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if body.stream and body.prompt_logprobs is not None and body.prompt_logprobs != 0:
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    count = None
    if body.logprobs:
        count = _count(top or 0, vocab_size)
        _check_bound("sample", "top_logprobs", count, max_logprobs, vocab_size)
    prompt = None if body.prompt_logprobs is None else _count(body.prompt_logprobs, vocab_size)
    if prompt is not None:
        _check_bound("prompt", "prompt_logprobs", prompt, max_logprobs, vocab_size)
    return count, prompt


class TokenText:
    """Token ids -> the text logprobs show for them (each token decoded alone, cached)."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False) -> None:
        self._as_token_ids = as_token_ids
        self._decode = lru_cache(maxsize=65536)(lambda token_id: str(tokenizer.decode([token_id]) or ""))

    def decoded(self, token_id: int) -> str:
        result: str = self._decode(token_id)
        return result

    def shown(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_token_ids else self.decoded(token_id)


def _clamp(value: float) -> float:
    return max(value, MIN_LOGPROB) if not math.isnan(value) else MIN_LOGPROB


def ranked(entry: Entry) -> list[tuple[int, float, int]]:
    """(token id, logprob, rank) of a position: its own token, then the top ones without it."""
    out = [(entry.token_id, entry.logprob, entry.rank)]
    for i, (token_id, value) in enumerate(zip(entry.top_token_ids, entry.top_logprobs, strict=True)):
        if token_id == entry.token_id:
            out[0] = (token_id, value, i + 1)
        else:
            out.append((token_id, value, i + 1))
    return out


@dataclass
class CompletionLogprobsBuilder:
    """Accumulates a completion's ``logprobs`` object over its positions."""

    num_top: int
    text: TokenText
    offset: int = 0  # text_offset of the next token
    out: CompletionLogprobs = field(default_factory=CompletionLogprobs)

    def add(self, token_id: int, entry: Entry | None) -> None:
        token = self.text.shown(token_id)
        self.out.text_offset.append(self.offset)
        self.offset += len(token)
        self.out.tokens.append(token)
        if entry is None:
            self.out.token_logprobs.append(None)
            self.out.top_logprobs.append(None)
            return
        self.out.token_logprobs.append(_clamp(entry.logprob))
        self.out.top_logprobs.append(
            {self.text.shown(t): _clamp(v) for t, v, _ in ranked(entry)[: self.num_top + 1]}
        )

    def add_all(self, token_ids: Sequence[int], entries: Sequence[Entry | None]) -> CompletionLogprobs:
        for token_id, entry in zip(token_ids, entries, strict=True):
            self.add(token_id, entry)
        return self.out


def prompt_positions(prompt_ids: Sequence[int], entries: Sequence[Entry]) -> list[Entry | None]:
    """One entry per prompt token: None for the first, then the prompt logprobs received."""
    if len(entries) != max(len(prompt_ids) - 1, 0):
        raise ValueError(f"expected {len(prompt_ids) - 1} prompt logprobs, got {len(entries)}")
    return [None, *entries]


def prompt_logprobs_field(
    entries: Sequence[Entry], num_top: int, text: TokenText
) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` of a completion choice."""
    out: list[dict[int, PromptLogprob] | None] = [None]
    for entry in entries:
        out.append(
            {
                t: PromptLogprob(logprob=_clamp(v), rank=r, decoded_token=text.decoded(t))
                for t, v, r in ranked(entry)[: num_top + 1]
            }
        )
    return out


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[Entry], num_top: int, text: TokenText
) -> ChatLogprobs:
    """A chat choice's ``logprobs``: one content entry per token."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        decoded = text.decoded(token_id)
        top = [
            ChatLogprob(
                token=(shown := text.shown(t)),
                logprob=_clamp(v),
                bytes=list(shown.encode("utf-8", "replace")),
            )
            for t, v, _ in ranked(entry)[:num_top]
        ]
        content.append(
            ChatTokenLogprob(
                token=text.shown(token_id),
                logprob=_clamp(entry.logprob),
                bytes=list(decoded.encode("utf-8", "replace")),
                top_logprobs=top,
            )
        )
    return ChatLogprobs(content=content)


@dataclass(frozen=True)
class CompletionShape:
    """What a completion request's choices show beyond the generated text: the echoed prompt, the
    logprobs, vLLM's ``prompt_logprobs``."""

    text: TokenText
    logprobs: int | None = None  # the request's count (None: no ``logprobs`` object)
    prompt_logprobs: int | None = None  # the count the prefill was asked for (None: none)
    echo: bool = False
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone
    prompt_text: str = ""
    prompt_ids: tuple[int, ...] = ()

    def render(
        self,
        text: str,
        token_ids: Sequence[int],
        entries: Sequence[Entry],
        prompt_entries: Sequence[Entry],
        first: bool,
        offset: int = 0,
    ) -> tuple[str, CompletionLogprobs | None]:
        """The text and ``logprobs`` of a whole completion, or of a streamed chunk (``first``: the
        stream's first; ``offset``: the completion text streamed before it)."""
        positions: list[Entry | None] = list(entries)
        if first and self.echo:
            prompt_positions_: list[Entry | None] = [None] * len(self.prompt_ids)
            if self.logprobs is not None:
                prompt_positions_ = prompt_positions(self.prompt_ids, prompt_entries)
            if self.echo_only:
                text, token_ids, positions = self.prompt_text, [], []
            else:
                text = self.prompt_text + text
            token_ids = [*self.prompt_ids, *token_ids]
            positions = [*prompt_positions_, *positions]
        if self.logprobs is None:
            return text, None
        builder = CompletionLogprobsBuilder(self.logprobs, self.text, offset)
        return text, builder.add_all(token_ids, positions)

    def prompt_field(self, prompt_entries: Sequence[Entry]) -> list[dict[int, PromptLogprob] | None] | None:
        if self.prompt_logprobs is None:
            return None
        return prompt_logprobs_field(prompt_entries, self.prompt_logprobs, self.text)


@dataclass(frozen=True)
class ChatShape:
    """What a chat request's response shows beyond the message: logprobs, vLLM's ``prompt_logprobs``."""

    text: TokenText
    top_logprobs: int | None = None  # how many most likely tokens each position lists (None: no logprobs)
    prompt_logprobs: int | None = None

    def render(self, token_ids: Sequence[int], entries: Sequence[Entry]) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        return chat_logprobs(token_ids, entries, self.top_logprobs, self.text)

    def prompt_field(self, prompt_entries: Sequence[Entry]) -> list[dict[int, PromptLogprob] | None] | None:
        if self.prompt_logprobs is None:
            return None
        return prompt_logprobs_field(prompt_entries, self.prompt_logprobs, self.text)
