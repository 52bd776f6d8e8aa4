"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` of the HTTP API, in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (tokenized with ``add_special_tokens``, default true) or chat
``messages`` (the chat template, with ``add_generation_prompt`` default true,
``continue_final_message``, ``documents``, ``tools`` and ``add_special_tokens`` default false, as
chat completions template them) and answers ``{count, max_model_len, tokens, token_strs}``
(``token_strs`` only with ``return_token_strs``). ``/detokenize`` takes ``{tokens}`` and answers
``{prompt}``, special tokens kept. Both check ``model`` when it is given (404 for another), bound
their input as the generation endpoints do and refuse more tokens than the model's context (400
naming the field). ``/version`` answers ``{"version": pdserve's version}``. As in vLLM, they lie
outside ``/v1``, so ``--api-key`` does not guard them.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

import pdserve
from gateway.input_limits import InputLimits
from gateway.openai_errors import OpenAIError, bad_request, model_not_found
from gateway.openai_models import ChatMessage
from gateway.openai_requests import ChatPrompt
from gateway.openai_tools import ChatTool
from gateway.prompt_input import PromptInput
from pdserve.core.limits import ModelLimits


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: exactly one of ``prompt``
    and ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizeApi:
    def __init__(self, prompts: PromptInput, limits: ModelLimits, inputs: InputLimits, model_id: str) -> None:
        self._prompts = prompts
        self._tokenizer = prompts.tokenizer
        self._chat = ChatPrompt(prompts.tokenizer)
        self._limits = limits
        self._inputs = inputs
        self._model_id = model_id

    async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        field = "messages" if body.messages is not None else "prompt"
        try:
            if body.messages is not None:
                self._inputs.check_texts(field, [m.text() for m in body.messages])
                messages = body.messages
                ids = await self._prompts.off_loop(
                    lambda: self._chat.token_ids(messages, body, bool(body.add_special_tokens))
                )
            else:
                text = body.prompt or ""
                self._inputs.check_prompt_text(text)
                add_special = body.add_special_tokens is not False
                ids = await self._prompts.off_loop(
                    lambda: list(self._tokenizer(text, add_special_tokens=add_special).input_ids)
                )
        except OpenAIError:
            raise
        except ValueError as exc:
            raise bad_request(str(exc), field) from exc
        self._check_length(field, len(ids))
        strs = self._tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        response = TokenizeResponse(
            count=len(ids), max_model_len=self._limits.max_model_len, tokens=ids, token_strs=strs
        )
        return JSONResponse(response.model_dump())

    async def detokenize(self, body: DetokenizeRequest) -> JSONResponse:
        self._check_model(body.model)
        try:
            self._inputs.check_prompt_ids(len(body.tokens))
        except ValueError as exc:
            raise bad_request(str(exc).replace("prompt_token_ids", "tokens", 1), "tokens") from exc
        self._check_length("tokens", len(body.tokens))
        vocab = self._limits.vocab_size
        for i, token in enumerate(body.tokens):
            if not 0 <= token < vocab:
                raise bad_request(f"tokens[{i}] = {token} is outside the vocabulary [0, {vocab})", "tokens")
        tokens = body.tokens
        text: Any = await self._prompts.off_loop(lambda: self._tokenizer.decode(tokens))
        return JSONResponse(DetokenizeResponse(prompt=str(text)).model_dump())

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": pdserve.__version__})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._model_id:
            raise model_not_found(model)

    def _check_length(self, field: str, count: int) -> None:
        if count > self._limits.max_model_len:
            raise bad_request(
                f"{field} has {count} tokens; the model's context is {self._limits.max_model_len}", field
            )
