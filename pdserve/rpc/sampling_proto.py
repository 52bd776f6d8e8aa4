"""SamplingParams <-> pdserve.v1.SamplingParams, at the edge of every service."""

from __future__ import annotations

from pdserve.core.sampling import SamplingParams
from pdserve.rpc.structured_output_proto import structured_from_proto, structured_to_proto
from pdserve.v1 import sampling_pb2

_DEFAULTS = SamplingParams()
# The optional fields that take ``defaults``' value when unset.
_OPTIONAL = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
)


def sampling_from_proto(
    msg: sampling_pb2.SamplingParams, defaults: SamplingParams = _DEFAULTS
) -> SamplingParams:
    """Applies ``defaults`` to unset fields and validates (ValueError names the bad field).

    ``defaults``: the gateway's are the model's generation config (``gateway.generation_defaults``);
    the engines are always sent every field."""
    values = {
        name: getattr(msg, name) if msg.HasField(name) else getattr(defaults, name) for name in _OPTIONAL
    }
    return SamplingParams(
        **values,
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
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        allowed_token_ids=tuple(msg.allowed_token_ids),
        bad_words=tuple(msg.bad_words),
        bad_words_token_ids=tuple(tuple(sequence.token_ids) for sequence in msg.bad_words_token_ids),
        include_stop_str_in_output=msg.include_stop_str_in_output,
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
        **{name: getattr(params, name) for name in _OPTIONAL},
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logit_bias=dict(params.logit_bias),
        allowed_token_ids=list(params.allowed_token_ids),
        bad_words=list(params.bad_words),
        bad_words_token_ids=[
            sampling_pb2.TokenSequence(token_ids=list(sequence)) for sequence in params.bad_words_token_ids
        ],
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
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
