"""From OpenAI request bodies to the gateway's GenerateRequest and SamplingParams, and back to
OpenAI's finish reasons. Raises OpenAIError or ValueError (both answered as 400)."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from gateway.openai_errors import bad_request
from gateway.openai_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FinishReason,
    SamplingFields,
)
from pdserve.core.finish import EOS, LENGTH, STOP
from pdserve.core.sampling import SamplingParams
from pdserve.v1 import gateway_pb2

_FINISH_REASONS: dict[str, FinishReason] = {EOS: "stop", STOP: "stop", LENGTH: "length"}
_DEFAULTS = SamplingParams()


def check_supported(body: SamplingFields) -> None:
    for param, why in body.unsupported():
        raise bad_request(why, param)


def sampling_params(body: SamplingFields, max_tokens: int) -> SamplingParams:
    """The request's sampling rules (ValueError names the bad field)."""
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    top_k = body.top_k if body.top_k is not None else _DEFAULTS.top_k
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature if body.temperature is not None else _DEFAULTS.temperature,
        top_p=body.top_p if body.top_p is not None else _DEFAULTS.top_p,
        top_k=0 if top_k == -1 else top_k,  # vLLM's "off"
        seed=body.seed,
        stop=stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
    )


def completion_input(body: CompletionRequest, request_id: str) -> gateway_pb2.GenerateRequest:
    """One prompt, as text or token ids; a batch of several prompts is refused."""
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request(f"prompt: one prompt per request is supported, got {len(prompt)}", "prompt")
        prompt = prompt[0]
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


class ChatPrompt:
    """The model's chat template over a whole conversation, ending with the assistant's turn."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def token_ids(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        if not getattr(self._tokenizer, "chat_template", None):
            raise bad_request("messages: this model has no chat template", "messages")
        conversation = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages
        ]
        try:
            text = self._tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except TemplateError as exc:
            raise bad_request(f"messages: the chat template refused them: {exc}", "messages") from exc
        return list(self._tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def openai_finish_reason(reason: str) -> FinishReason:
    """ "eos" and "stop" are OpenAI's "stop"; "length" stays."""
    return _FINISH_REASONS.get(reason, "stop")
