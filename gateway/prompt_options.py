"""vLLM's prompt fields of the HTTP API: ``truncate_prompt_tokens`` (with ``truncation_side``) and,
for completions, ``add_special_tokens``.

``truncate_prompt_tokens = k`` keeps k tokens of the prompt: its last k (``truncation_side``
"left", the default) or its first k ("right"); -1 keeps the model's context length. A text prompt
that needs either is tokenized here (its token ids then go to the request flow).
"""

from __future__ import annotations

from gateway.openai_models import CompletionRequest, SamplingFields
from gateway.prompt_input import PromptInput
from pdserve.v1 import gateway_pb2


def truncated(ids: list[int], body: SamplingFields, max_model_len: int) -> list[int]:
    """``ids`` truncated as the request asks (ValueError names the field)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens ({keep}) must be at most the model's context {max_model_len}"
        )
    if len(ids) <= keep:
        return ids
    return ids[:keep] if body.truncation_side == "right" else ids[len(ids) - keep :]


async def completion_prompt(
    body: CompletionRequest, request: gateway_pb2.GenerateRequest, prompts: PromptInput
) -> gateway_pb2.GenerateRequest:
    """``request`` with the prompt options applied (token ids in place of text when they need it)."""
    if body.truncate_prompt_tokens is None and body.add_special_tokens:
        return request
    ids = list(request.prompt_token_ids)
    if request.prompt:
        text, special = request.prompt, body.add_special_tokens
        ids = await prompts.off_loop(
            lambda: list(prompts.tokenizer(text, add_special_tokens=special).input_ids)
        )
        if not ids:
            raise ValueError("prompt must not be empty: it tokenizes to no tokens")
    ids = truncated(ids, body, prompts.limits.max_model_len)
    return gateway_pb2.GenerateRequest(request_id=request.request_id, prompt_token_ids=ids)
