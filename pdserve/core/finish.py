"""When a request ends, and why: the rules every stage applies to the tokens it samples.

1. Token rules, on ids, judged by whoever samples the token (the prefill for the first token, the
   decode for every later one; a decode given a request already complete at its first token ends
   it without running it): the model's end-of-sequence token (unless ``ignore_eos``) ends it with
   ``eos``, a token of ``stop_token_ids`` with ``stop`` (the token is returned), and the
   ``max_tokens``-th token with ``length``.
2. Stop strings, on text, judged by the gateway over the whole stream (``gateway.stop_strings``):
   the text is cut right before the first stop string (after it with ``include_stop_str_in_output``),
   wherever tokens split it; text of the first ``min_tokens`` tokens is not checked, as vLLM.
3. The first token also ends the request when its own text contains a stop string
   (``first_token_reason``): the gateway would stop there anyway, so the prefill parks no KV and
   the request never reaches decode.
A resumed request (prefilled again with the tokens it had generated, when its decode was lost)
counts those tokens in every rule: its prefill's token is not its first one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from pdserve.core.sampling import SamplingParams

EOS = "eos"
STOP = "stop"
LENGTH = "length"


def finish_reason(
    token_id: int, num_generated: int, params: SamplingParams, eos_token_ids: Collection[int]
) -> str | None:
    """The reason the request ends at this token by the token rules, or None when it continues.

    ``num_generated`` counts the generated tokens including ``token_id``.
    """
    if not params.ignore_eos and token_id in eos_token_ids:
        return EOS
    if token_id in params.stop_token_ids:
        return STOP
    if num_generated >= params.max_tokens:
        return LENGTH
    return None


def first_token_reason(
    token_id: int,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    token_text: Callable[[int], str],
    num_before: int = 0,
) -> str | None:
    """The reason a request ends at the token its prefill sampled (token rules, then stop strings
    in that token's own text, decoded by ``token_text``), or None when it goes on to decode.

    ``num_before``: tokens the request generated before this one (a resumed request), counted by
    ``max_tokens``."""
    reason = finish_reason(token_id, num_before + 1, params, eos_token_ids)
    checks_text = num_before + 1 > params.min_tokens  # stop strings count only after min_tokens
    if reason is None and checks_text and params.stop and any(s in token_text(token_id) for s in params.stop):
        return STOP
    return reason
