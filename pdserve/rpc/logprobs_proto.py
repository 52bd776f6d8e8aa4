"""TokenLogprobs <-> pdserve.v1.TokenLogprobs, at the edge of every service."""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.core.logprobs import TokenLogprobs
from pdserve.v1 import sampling_pb2


def logprobs_to_proto(entry: TokenLogprobs) -> sampling_pb2.TokenLogprobs:
    return sampling_pb2.TokenLogprobs(
        token_id=entry.token_id,
        logprob=entry.logprob,
        rank=entry.rank,
        top_token_ids=entry.top_token_ids,
        top_logprobs=entry.top_logprobs,
    )


def logprobs_list_to_proto(entries: Iterable[TokenLogprobs | None]) -> list[sampling_pb2.TokenLogprobs]:
    """The entries that are set (a request without logprobs has none)."""
    return [logprobs_to_proto(e) for e in entries if e is not None]
