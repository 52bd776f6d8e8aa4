"""SamplingParams <-> pdserve.v1.SamplingParams, at the edge of every service."""

from __future__ import annotations

from pdserve.core.sampling import SamplingParams
from pdserve.rpc.structured_output_proto import structured_from_proto, structured_to_proto
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
        n=msg.n if msg.HasField("n") else _DEFAULTS.n,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        structured_output=structured_from_proto(msg.structured_output)
        if msg.HasField("structured_output")
        else None,
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
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.n != 1:
        msg.n = params.n
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.structured_output is not None:
        msg.structured_output.CopyFrom(structured_to_proto(params.structured_output))
    return msg
