"""SamplingParams <-> pdserve.v1.SamplingParams, at the edge of every service."""

from __future__ import annotations

from pdserve.core.sampling import SamplingParams
from pdserve.v1 import sampling_pb2

_DEFAULTS = SamplingParams()


def sampling_from_proto(msg: sampling_pb2.SamplingParams) -> SamplingParams:
    """Applies defaults to unset fields and validates (ValueError names the bad field)."""
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else _DEFAULTS.max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else _DEFAULTS.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else _DEFAULTS.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else _DEFAULTS.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        skip_special_tokens=(
            msg.skip_special_tokens if msg.HasField("skip_special_tokens") else _DEFAULTS.skip_special_tokens
        ),
        spaces_between_special_tokens=(
            msg.spaces_between_special_tokens
            if msg.HasField("spaces_between_special_tokens")
            else _DEFAULTS.spaces_between_special_tokens
        ),
    )


def sampling_to_proto(params: SamplingParams) -> sampling_pb2.SamplingParams:
    msg = sampling_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg
