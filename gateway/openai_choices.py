"""The choices of one OpenAI request (``n``), each counted on its own, by index.

Responses of the request flow carry their choice's ``index``; each choice's text, token count and
finish reason add up apart. The usage counts the prompt once (and its tokens taken from the prefix
cache, ``prompt_tokens_details.cached_tokens``) and the completion tokens of every choice, as
OpenAI and vLLM count them. A whole (not streamed) response lists the choices by index.
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
    def __init__(self, new: Callable[[], C]) -> None:
        self._new = new
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

    def usage(self) -> Usage:
        prompt = max((c.prompt_tokens for c in self._choices.values()), default=0)
        cached = max((c.cached_tokens for c in self._choices.values()), default=0)
        completion = sum(c.completion_tokens for c in self._choices.values())
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )
