"""When a request is complete, judged on token ids (stop strings are the gateway's business)."""

from __future__ import annotations

from collections.abc import Collection

from pdserve.core.sampling import SamplingParams

EOS = "eos"
STOP = "stop"
LENGTH = "length"


def finish_reason(
    token_id: int, num_generated: int, params: SamplingParams, eos_token_ids: Collection[int]
) -> str | None:
    """The reason the request ends at this token, or None when it continues.

    ``num_generated`` counts the generated tokens including ``token_id``.
    """
    if not params.ignore_eos and token_id in eos_token_ids:
        return EOS
    if token_id in params.stop_token_ids:
        return STOP
    if num_generated >= params.max_tokens:
        return LENGTH
    return None
