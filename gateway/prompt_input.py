"""From a GenerateRequest's input fields to validated prompt token ids.

Tokenization and chat templating take time in proportion to the prompt: they run on a bounded pool
of threads (``--tokenizer-threads``), never on the gateway's event loop, so that one long prompt
does not hold up the streams of other requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from pdserve.core.limits import ModelLimits
from pdserve.core.sampling import SamplingParams
from pdserve.v1 import gateway_pb2

T = TypeVar("T")


class PromptInput:
    def __init__(self, tokenizer: Any, limits: ModelLimits, executor: Executor | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self._executor = executor

    async def off_loop(self, work: Callable[[], T]) -> T:
        """``work()`` on the tokenizer threads (on this thread when there are none)."""
        if self._executor is None:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def token_ids(self, request: gateway_pb2.GenerateRequest, params: SamplingParams) -> list[int]:
        """Raises ValueError naming the field when the input is missing, ambiguous or too long."""
        has_text = bool(request.prompt)
        has_ids = len(request.prompt_token_ids) > 0
        if has_text and has_ids:
            raise ValueError("give exactly one of prompt and prompt_token_ids, not both")
        if not has_text and not has_ids:
            raise ValueError("prompt must not be empty (give prompt or prompt_token_ids)")
        if has_ids:
            if request.apply_chat_template:
                raise ValueError("apply_chat_template needs prompt text, not prompt_token_ids")
            ids = list(request.prompt_token_ids)
        elif request.apply_chat_template:
            ids = await self.off_loop(lambda: self._chat_ids(request.prompt))
        else:
            ids = await self.off_loop(lambda: list(self.tokenizer(request.prompt).input_ids))
        if not ids:
            raise ValueError("prompt must not be empty: it tokenizes to no tokens")
        self.limits.check_request(ids, params)
        return ids

    def _chat_ids(self, prompt: str) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("apply_chat_template: this model has no chat template")
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)
