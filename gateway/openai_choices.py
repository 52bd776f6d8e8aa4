"""The choices of one OpenAI request (``n``), each counted on its own, by index.

Responses of the request flow carry their choice's ``index``; each choice's text, token count and
finish reason add up apart. The usage counts the prompt once (and its tokens taken from the prefix
cache, ``prompt_tokens_details.cached_tokens``) and the completion tokens of every choice, as
OpenAI and vLLM count them; a batch of prompts (``gateway.prompt_batch``, ``per_prompt`` choices
each) counts each prompt once. A whole (not streamed) response lists the choices by index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from gateway.openai_models import FinishReason, PromptTokensDetails, Usage
from pdserve.v1 import gateway_pb2


class ChoiceCount(Protocol):
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    def add(self, response: gateway_pb2.GenerateResponse) -> FinishReason | None: ...


C = TypeVar("C", bound=ChoiceCount)


class Choices(Generic[C]):
    def __init__(self, new: Callable[[], C], per_prompt: int | None = None) -> None:
        """``per_prompt``: the choices of each prompt of a batch (None: one prompt)."""
        self._new = new
        self._per_prompt = per_prompt
        self._choices: dict[int, C] = {}

    def add(self, response: gateway_pb2.GenerateResponse) -> FinishReason | None:
        """Counts one response to its choice; that choice's finish reason, or None while it goes on."""
        return self.choice(response.index).add(response)

    def choice(self, index: int) -> C:
        if index not in self._choices:
            self._choices[index] = self._new()
        return self._choices[index]

    def is_new(self, index: int) -> bool:
        """Whether no response of choice ``index`` was counted yet."""
        return index not in self._choices

    def by_index(self) -> list[tuple[int, C]]:
        return sorted(self._choices.items())

    def _group(self, index: int) -> int:
        return 0 if self._per_prompt is None else index // self._per_prompt

    def usage(self) -> Usage:
        prompts: dict[int, tuple[int, int]] = {}  # prompt -> its tokens, those cached
        for index, c in self._choices.items():
            prompt = self._group(index)
            tokens, cached = prompts.get(prompt, (0, 0))
            prompts[prompt] = (max(tokens, c.prompt_tokens), max(cached, c.cached_tokens))
        prompt_tokens = sum(tokens for tokens, _ in prompts.values())
        cached_tokens = sum(cached for _, cached in prompts.values())
        completion = sum(c.completion_tokens for c in self._choices.values())
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion,
            total_tokens=prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


def choice_usage(choices: Choices[C], index: int, before: bool = False) -> Usage:
    """Choice ``index``'s usage so far: its prompt's tokens (each choice's first response gives
    them) and its own (vLLM's continuous usage); ``before``: as it stands before its first token
    (a chat stream's role chunk)."""
    choice = choices.choice(index)
    prompt = choice.prompt_tokens
    completion = 0 if before else choice.completion_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
