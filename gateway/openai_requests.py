"""From OpenAI request bodies to the gateway's GenerateRequest and SamplingParams, and back to
OpenAI's finish reasons. Raises OpenAIError or ValueError (both answered as 400)."""

from __future__ import annotations

import math
from typing import Any, Protocol, TypeVar

from jinja2 import TemplateError

from gateway.openai_errors import bad_request
from gateway.openai_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FinishReason,
    SamplingFields,
)
from gateway.openai_tools import ChatTool
from gateway.prompt_batch import prompt_request_id
from gateway.structured_request import structured_output
from gateway.tool_calls import template_call, template_tools
from pdserve.core.finish import EOS, LENGTH, STOP
from pdserve.core.sampling import SamplingParams
from pdserve.v1 import gateway_pb2

_FINISH_REASONS: dict[str, FinishReason] = {EOS: "stop", STOP: "stop", LENGTH: "length"}
_DEFAULTS = SamplingParams()
T = TypeVar("T")


def check_supported(body: SamplingFields) -> None:
    for param, why in body.unsupported():
        raise bad_request(why, param)


def sampling_params(
    body: SamplingFields, max_tokens: int, defaults: SamplingParams = _DEFAULTS
) -> SamplingParams:
    """The request's sampling rules (ValueError names the bad field); ``defaults`` fill the fields
    it omits (the model's generation config, ``gateway.generation_defaults``)."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    top_k = body.top_k if body.top_k is not None else defaults.top_k
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_given(body.temperature, defaults.temperature),
        top_p=_given(body.top_p, defaults.top_p),
        top_k=0 if top_k == -1 else top_k,  # vLLM's "off"
        seed=body.seed,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        n=body.n,
        structured_output=structured_output(body),
        presence_penalty=_given(body.presence_penalty, defaults.presence_penalty),
        frequency_penalty=_given(body.frequency_penalty, defaults.frequency_penalty),
        repetition_penalty=_given(body.repetition_penalty, defaults.repetition_penalty),
        min_p=_given(body.min_p, defaults.min_p),
        min_tokens=body.min_tokens,
        logit_bias=logit_bias(body.logit_bias),
        allowed_token_ids=allowed_token_ids(body.allowed_token_ids),
        bad_words=tuple(body.bad_words or ()),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
    )


def _given(value: T | None, default: T) -> T:
    return default if value is None else value


def logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}, each bias clamped to [-100, 100] as vLLM does."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias key {key[:32]!r} is not a token id") from None
        if math.isnan(value):
            raise ValueError(f"logit_bias[{token}] must be a number, got NaN")
        out[token] = min(100.0, max(-100.0, value))
    return tuple(sorted(out.items()))


def allowed_token_ids(ids: list[int] | None) -> tuple[int, ...]:
    if ids is not None and not ids:
        raise ValueError("allowed_token_ids must not be empty")
    return tuple(dict.fromkeys(ids or ()))


def completion_inputs(body: CompletionRequest, request_id: str) -> list[gateway_pb2.GenerateRequest]:
    """The request's prompts, as text or token ids: one, or a batch (a list of texts or of
    token-id lists), each with its id (``gateway.prompt_batch``)."""
    prompt: Any = body.prompt
    batch: list[Any] = (
        prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
    )
    return [
        _prompt_request(one, prompt_request_id(request_id, position, len(batch)))
        for position, one in enumerate(batch)
    ]


def _prompt_request(prompt: str | list[int], request_id: str) -> gateway_pb2.GenerateRequest:
    if isinstance(prompt, str):
        return gateway_pb2.GenerateRequest(request_id=request_id, prompt=prompt)
    return gateway_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt)


def completion_max_tokens(body: CompletionRequest) -> int:
    return body.max_tokens if body.max_tokens is not None else _DEFAULTS.max_tokens


def chat_max_tokens(body: ChatCompletionRequest, num_prompt_tokens: int, max_model_len: int) -> int:
    """max_completion_tokens, else max_tokens, else the rest of the context."""
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens
    if body.max_tokens is not None:
        return body.max_tokens
    return max(max_model_len - num_prompt_tokens, 1)


def max_tokens_param(body: ChatCompletionRequest) -> dict[str, str]:
    """How the error of a chat request names max_tokens: the field the client used."""
    if body.max_completion_tokens is not None:
        return {"max_tokens": "max_completion_tokens"}
    return {}


class TemplateFields(Protocol):
    """vLLM's templating fields of a chat request (and of ``/tokenize``'s messages)."""

    add_generation_prompt: bool
    continue_final_message: bool
    documents: list[dict[str, str]] | None
    tools: list[ChatTool] | None


class ChatPrompt:
    """The model's chat template over a whole conversation, ending with the assistant's turn."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def token_ids(
        self, messages: list[ChatMessage], fields: TemplateFields, add_special_tokens: bool = False
    ) -> list[int]:
        """The template over ``messages`` with ``fields`` as vLLM's (``add_generation_prompt``,
        ``continue_final_message``, ``documents``, ``tools``); ``add_special_tokens``: the
        tokenizer's own special tokens on top of the template's."""
        if not getattr(self._tokenizer, "chat_template", None):
            raise bad_request("messages: this model has no chat template", "messages")
        if fields.add_generation_prompt and fields.continue_final_message:
            raise bad_request(
                "continue_final_message cannot be used with add_generation_prompt", "continue_final_message"
            )
        conversation = [_template_message(m) for m in messages]
        options: dict[str, Any] = {
            "add_generation_prompt": fields.add_generation_prompt,
            "continue_final_message": fields.continue_final_message,
        }
        if fields.documents is not None:
            options["documents"] = fields.documents
        if fields.tools:
            options["tools"] = template_tools(fields.tools)
        try:
            text = self._tokenizer.apply_chat_template(conversation, tokenize=False, **options)
        except (TemplateError, ValueError) as exc:
            raise bad_request(f"messages: the chat template refused them: {exc}", "messages") from exc
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it (``developer`` is ``system`` to them)."""
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [template_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def openai_finish_reason(reason: str) -> FinishReason:
    """ "eos" and "stop" are OpenAI's "stop"; "length" stays."""
    return _FINISH_REASONS.get(reason, "stop")
