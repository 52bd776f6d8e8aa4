"""Request and response bodies of the OpenAI-compatible HTTP API (the fields pdserve serves).

Fields that OpenAI or vLLM define but pdserve does not serve are accepted only at their neutral
values (see ``unsupported``); unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.openai_structured import StructuredFields
from gateway.openai_tools import ChatTool, DeltaToolCall, ToolCall, ToolChoice
from gateway.refused_fields import refused_chat_fields, refused_fields

# --- requests ------------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # with include_usage: each chunk's choice's usage so far (vLLM's)


class SamplingFields(StructuredFields):
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
    user: str | None = None  # ignored, as vLLM
    timeout: float | None = None  # seconds the request may take (see gateway.http_api)
    # The logits processors and stop handling (``gateway.sampling_fields``), as vLLM's.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # ``gateway.bad_words``
    include_stop_str_in_output: bool = False
    # Prompt handling (``gateway.prompt_options``).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the output's token ids in the response
    # vLLM fields pdserve refuses unless neutral (``refused_fields``).
    priority: int = 0
    use_beam_search: bool = False
    watermarking: bool | None = None
    prompt_embeds: Any = None
    return_tokens_as_token_ids: bool | None = None
    logprob_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    skip_special_tokens: bool = True  # vLLM's: the text leaves special tokens out
    spaces_between_special_tokens: bool = True  # vLLM's (see gateway.detokenizer)

    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries its choice's usage so far (vLLM's
        ``stream_options.continuous_usage_stats``, with ``include_usage``)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for each field set to something pdserve cannot do."""
        out: list[tuple[str, str]] = []
        out.extend(refused_fields(self))
        return out


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None  # see gateway.openai_logprobs
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
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

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls (``gateway.tool_calls``)
    tool_call_id: str | None = None  # the call a tool message answers

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
    logprobs: bool = False  # see gateway.openai_logprobs
    top_logprobs: int | None = 0
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    tools: list[ChatTool] | None = None  # ``gateway.tool_calls``
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Chat templating (``gateway.openai_requests.ChatPrompt``), as vLLM's.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    # Refused unless neutral (``refused_chat_fields``); ignored as vLLM without a reasoning
    # parser: include_reasoning.
    reasoning_effort: str | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    echo: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        out.extend(refused_chat_fields(self))
        return out


# --- responses -----------------------------------------------------------------------------------

FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefill's prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def _is_none(value: object) -> bool:
    return value is None


StopReason = int | str | None  # the stop token id or stop string that ended a choice (vLLM's field)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM's: the prompt's logprobs (whole responses of requests that ask for them).
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = Field(default=None, exclude_if=_is_none)
    stop_reason: StopReason = None
    # vLLM's return_token_ids: the prompt's ids and the choice's generated ids.
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)


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
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)  # as vLLM: [] when none


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason
    stop_reason: StopReason = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # vLLM's return_token_ids


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    # vLLM's: the prompt's logprobs (requests that ask for them).
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = Field(default=None, exclude_if=_is_none)
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # vLLM's return_token_ids


class Delta(BaseModel):
    """What a chat chunk adds; unset fields are left out (the last chunk's delta is ``{}``)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[DeltaToolCall] | None = Field(default=None, exclude_if=_is_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: StopReason = None
    token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # vLLM's return_token_ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=_is_none)  # on the first chunk


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
