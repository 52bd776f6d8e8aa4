"""vLLM request fields pdserve does not serve: each is refused (400 naming it) unless neutral.

vLLM accepts these on ``/v1/completions`` and ``/v1/chat/completions``; pdserve answers the
neutral value (unset, false, 0, empty) as vLLM does and refuses any other, so that no field is
silently dropped. Fields without effect on the output in pdserve's setting are ignored, as vLLM
ignores them there: ``user``; ``length_penalty`` (beam search only); ``session_id``,
``cache_salt`` (routing and prefix-cache hints; pdserve keeps no prefix cache across requests);
``stream_interval`` (chunking only); ``return_token_offsets``, ``return_mm_kwargs`` (render
endpoints only); ``routed_experts_prompt_start``; chat ``include_reasoning`` (no reasoning
parser).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.openai_models import ChatCompletionRequest, SamplingFields

# (field, what pdserve accepts) for fields refused when set to anything but unset/false/empty.
_UNSET_ONLY = (
    ("use_beam_search", "beam search is not supported"),
    ("watermarking", "watermarking is not supported"),
    ("prompt_embeds", "prompt_embeds is not supported"),
    ("logprob_token_ids", "logprob_token_ids is not supported"),
    ("kv_transfer_params", "kv_transfer_params is not supported"),
    ("ec_transfer_params", "ec_transfer_params is not supported"),
    ("vllm_xargs", "vllm_xargs is not supported"),
    ("repetition_detection", "repetition_detection is not supported"),
)
_CHAT_UNSET_ONLY = (
    ("reasoning_effort", "reasoning_effort is not supported (no reasoning model)"),
    ("chat_template", "a request's own chat_template is not accepted"),
    ("chat_template_kwargs", "chat_template_kwargs is not supported"),
    ("mm_processor_kwargs", "mm_processor_kwargs is not supported (text models only)"),
    ("media_io_kwargs", "media_io_kwargs is not supported (text models only)"),
    ("echo", "echo is not supported"),
)


def refused_fields(body: SamplingFields) -> list[tuple[str, str]]:
    """(field, why) for each field of completions and chat set to what pdserve does not do."""
    out = [(name, why) for name, why in _UNSET_ONLY if getattr(body, name)]
    if body.priority != 0:
        out.append(("priority", f"priority must be 0 (no priority scheduling), got {body.priority}"))
    if body.thinking_token_budget not in (None, -1):
        out.append(("thinking_token_budget", "thinking_token_budget is not supported"))
    return out


def refused_chat_fields(body: ChatCompletionRequest) -> list[tuple[str, str]]:
    """(field, why) for the chat-only fields."""
    out = [(name, why) for name, why in _CHAT_UNSET_ONLY if getattr(body, name)]
    return out
