"""Request and response bodies of the OpenAI-compatible HTTP API (the fields pdserve serves).

Fields that OpenAI or vLLM define but pdserve does not serve are accepted only at their neutral
values (see ``unsupported``); unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# --- requests ------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share; ``top_k`` and ``ignore_eos`` as vLLM has them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    timeout: float | None = None  # seconds the request may take (see gateway.http_api)
    skip_special_tokens: bool = True  # vLLM's: the text leaves special tokens out
    spaces_between_special_tokens: bool = True  # vLLM's (see gateway.detokenizer)

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for each field set to something pdserve cannot do."""
        out: list[tuple[str, str]] = []
        if self.n != 1:
            out.append(("n", f"n must be 1 (one choice per request), got {self.n}"))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0):
                out.append((name, f"{name} is not supported (leave it unset or 0)"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported"))
        return out


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.logprobs is not None:
            out.append(("logprobs", "logprobs is not supported"))
        if self.best_of not in (None, 1):
            out.append(("best_of", f"best_of must be 1, got {self.best_of}"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        return out


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    tools: list[Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs:
            out.append(("logprobs", "logprobs is not supported"))
        if self.tools:
            out.append(("tools", "tools are not supported"))
        return out


# --- responses -----------------------------------------------------------------------------------

FinishReason = Literal["stop", "length"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    """A whole completion, and also one streamed chunk of it (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


def _is_none(value: object) -> bool:
    return value is None


class Delta(BaseModel):
    """What a chat chunk adds; unset fields are left out (the last chunk's delta is ``{}``)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelPermission(BaseModel):
    """vLLM's model permission object (informational: pdserve grants what it lists)."""

    id: str
    object: Literal["model_permission"] = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """The model object of ``/v1/models`` and ``/v1/models/{id}``, in vLLM's shape."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    root: str | None = None  # the model the gateway was started with (--model)
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
