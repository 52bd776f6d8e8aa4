"""The logits processors against independent references (transformers' processors where one
exists, the formulas otherwise), their validation, the proto conversion and the decode's view of
a resumed request."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from decode_service.servicer import _check_history, decode_processor
from gateway.generation_defaults import generation_defaults
from gateway.stop_strings import StopStringMatcher
from pdserve.core.finish import first_token_reason
from pdserve.core.limits import ModelLimits
from pdserve.core.logits_processing import LogitsProcessor, pick, request_processor
from pdserve.core.sampling import SamplingParams, min_p_filter
from pdserve.rpc.sampling_proto import sampling_from_proto, sampling_to_proto
from pdserve.v1 import decode_pb2, kv_pb2, sampling_pb2

VOCAB = 50
EOS = 7


def logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_equals_transformers() -> None:
    prompt, output = [1, 4, 4, 9, 30], [9, 12, 3]
    for penalty in (0.5, 1.3, 2.0):
        params = SamplingParams(repetition_penalty=penalty)
        got = LogitsProcessor(params, {EOS}, prompt, output).apply(logits(1))
        expected = RepetitionPenaltyLogitsProcessor(penalty)(
            torch.tensor([prompt + output]), logits(1)[None]
        )[0]
        torch.testing.assert_close(got, expected)


def test_presence_and_frequency_penalties_follow_the_formula() -> None:
    prompt, output = [2, 2, 5], [5, 8, 8, 8, 11]
    params = SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4)
    got = LogitsProcessor(params, {EOS}, prompt, output).apply(logits(2))
    expected = logits(2).clone()
    for token in set(output):  # the output only: prompt tokens (2) are not penalised
        expected[token] -= 0.7 + -0.4 * output.count(token)
    torch.testing.assert_close(got, expected)


def test_append_counts_each_sampled_token() -> None:
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5)
    grown = LogitsProcessor(params, {EOS}, [1, 2], [3])
    grown.apply(logits())  # builds its tensors: later tokens are counted in them
    for token in (3, 20, 20):
        grown.append(token)
    fresh = LogitsProcessor(params, {EOS}, [1, 2], [3, 3, 20, 20])
    torch.testing.assert_close(grown.apply(logits(3)), fresh.apply(logits(3)))
    assert grown.num_output == fresh.num_output == 4


def test_min_p_equals_transformers() -> None:
    scores = logits(4)[None] / 0.8
    for min_p in (0.05, 0.3, 0.9):
        torch.testing.assert_close(min_p_filter(scores, min_p), MinPLogitsWarper(min_p)(None, scores.clone()))


def test_min_tokens_masks_eos_and_stop_tokens_as_transformers() -> None:
    params = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=(11,))
    reference = MinNewTokensLengthLogitsProcessor(2, 3, [EOS, 11])
    processor = LogitsProcessor(params, {EOS}, [1, 2], [])
    for step in range(5):
        ids = torch.tensor([[1, 2, *range(20, 20 + step)]])
        torch.testing.assert_close(
            processor.apply(logits(step)), reference(ids, logits(step)[None].clone())[0]
        )
        processor.append(20 + step)
    ignoring = LogitsProcessor(dataclasses.replace(params, ignore_eos=True), {EOS}, [1], []).apply(logits())
    assert ignoring[EOS] == logits()[EOS] and ignoring[11] == float("-inf")


def test_logit_bias_and_allowed_token_ids() -> None:
    params = SamplingParams(logit_bias=((3, 100.0), (4, -2.5)), allowed_token_ids=(3, 4, 5))
    got = LogitsProcessor(params, {EOS}, [1], []).apply(logits(5))
    assert got[3] == logits(5)[3] + 100 and got[4] == logits(5)[4] - 2.5 and got[5] == logits(5)[5]
    assert torch.isinf(got[[i for i in range(VOCAB) if i not in (3, 4, 5)]]).all()
    biased = SamplingParams(temperature=0.0, logit_bias=((9, 100.0),))
    assert pick(logits(5), biased, 0, request_processor(biased, {EOS}, [1], 0)) == 9


def test_plain_requests_take_the_fast_path() -> None:
    assert request_processor(SamplingParams(), {EOS}, [1, 2], 0) is None
    assert request_processor(SamplingParams(temperature=0.0, min_p=0.5), {EOS}, [1], 0) is None
    assert request_processor(SamplingParams(min_p=0.5, seed=1), {EOS}, [1], 0) is not None


def test_resumed_request_counts_its_generated_tokens_as_output() -> None:
    """A resumed request: the KV's last num_generated tokens are output, as are the first token and
    every token after it; the decode's processor equals one built from the split lists."""
    params = SamplingParams(max_tokens=10, presence_penalty=1.0, repetition_penalty=1.2, min_tokens=4)
    request = decode_pb2.DecodeRequest(
        first_token_id=13,
        num_generated=2,
        prompt_token_ids=[1, 2, 3, 21, 22],
        kv_handle=kv_pb2.KvHandle(num_tokens=5),
    )
    got = decode_processor(request, params, frozenset({EOS}))
    assert got is not None and got.num_output == 3
    expected = LogitsProcessor(params, {EOS}, [1, 2, 3], [21, 22, 13])
    torch.testing.assert_close(got.apply(logits(6)), expected.apply(logits(6)))
    assert got.apply(logits(6))[EOS] == float("-inf")  # 3 of min_tokens = 4
    got.append(30)
    assert got.apply(logits(6))[EOS] != float("-inf")
    # min_tokens alone needs no token ids: the count comes from num_generated.
    counted = decode_processor(
        decode_pb2.DecodeRequest(first_token_id=13, num_generated=3, kv_handle=kv_pb2.KvHandle(num_tokens=5)),
        SamplingParams(max_tokens=10, min_tokens=4),
        frozenset({EOS}),
    )
    assert counted is not None and counted.num_output == 4


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], r"prompt_token_ids has 0 ids"),
        ([1, 2, 3], r"prompt_token_ids has 3 ids"),
        ([1] * 10**4, r"prompt_token_ids has 10000 ids"),
        ([1, 2, 3, 4, VOCAB], r"prompt_token_ids\[4\] = 50 is outside the vocabulary"),
        ([1, 2, -1, 4, 5], r"prompt_token_ids\[2\] = -1 is outside the vocabulary"),
    ],
)
def test_decode_refuses_hostile_token_history(ids: list[int], message: str) -> None:
    request = decode_pb2.DecodeRequest(prompt_token_ids=ids, kv_handle=kv_pb2.KvHandle(num_tokens=5))
    with pytest.raises(ValueError, match=message):
        _check_history(request, SamplingParams(repetition_penalty=1.1), VOCAB)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"presence_penalty": 2.5}, r"^sampling\.presence_penalty must be in \[-2, 2\], got 2.5$"),
        ({"frequency_penalty": float("nan")}, r"^sampling\.frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"^sampling\.repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": float("inf")}, r"^sampling\.repetition_penalty must be a finite number > 0"),
        ({"min_p": 1.5}, r"^sampling\.min_p must be in \[0, 1\]"),
        ({"min_tokens": 17}, r"^sampling\.min_tokens must be in \[0, max_tokens = 16\], got 17$"),
        ({"min_tokens": -1}, r"^sampling\.min_tokens must be in"),
        ({"logit_bias": ((1, 100.5),)}, r"^sampling\.logit_bias\[1\] must be in \[-100, 100\]"),
        ({"logit_bias": ((1, float("nan")),)}, r"^sampling\.logit_bias\[1\] must be in \[-100, 100\]"),
        ({"logit_bias": ((-3, 1.0),)}, r"^sampling\.logit_bias has token id -3"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, r"^sampling\.logit_bias must name each token id once$"),
        ({"allowed_token_ids": (1, -2)}, r"^sampling\.allowed_token_ids must be >= 0$"),
    ],
)
def test_invalid_fields_are_refused_by_name(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)  # type: ignore[arg-type]


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    limits = ModelLimits(VOCAB, 100, frozenset({EOS}))
    with pytest.raises(ValueError, match=r"^sampling\.logit_bias has token id 50, outside"):
        limits.check_request([1], SamplingParams(logit_bias=((50, 1.0),)))
    with pytest.raises(ValueError, match=r"^sampling\.allowed_token_ids has 99, outside"):
        limits.check_request([1], SamplingParams(allowed_token_ids=(99,)))


def test_proto_round_trip_and_hostile_values() -> None:
    params = SamplingParams(
        max_tokens=9,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.25,
        min_p=0.125,
        min_tokens=3,
        logit_bias=((2, -100.0), (40, 7.5)),
        allowed_token_ids=(2, 40),
        include_stop_str_in_output=True,
    )
    assert sampling_from_proto(sampling_to_proto(params)) == params
    for hostile, field in (
        (sampling_pb2.SamplingParams(min_tokens=2**32 - 1), "min_tokens"),
        (sampling_pb2.SamplingParams(logit_bias={-(2**31): 1.0}), "logit_bias"),
        (sampling_pb2.SamplingParams(logit_bias={3: 1e30}), "logit_bias"),
        (sampling_pb2.SamplingParams(repetition_penalty=-1), "repetition_penalty"),
    ):
        with pytest.raises(ValueError, match=field):
            sampling_from_proto(hostile)


def test_unset_fields_take_the_defaults() -> None:
    defaults = SamplingParams(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, min_p=0.05)
    got = sampling_from_proto(sampling_pb2.SamplingParams(max_tokens=4, top_k=3), defaults)
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty, got.min_p) == pytest.approx(
        (0.6, 0.9, 3, 1.1, 0.05)
    )


def test_generation_config_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {"temperature": 0.6, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.1, "eos_token_id": 2}
        )
    )
    got = generation_defaults("auto", str(tmp_path))
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty, got.min_p) == (
        0.6,
        0.9,
        0,
        1.1,
        0.0,
    )
    assert generation_defaults("vllm", str(tmp_path)) == SamplingParams()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert generation_defaults("auto", str(empty)) == SamplingParams()
    assert generation_defaults(str(tmp_path), str(empty)).temperature == 0.6
    with pytest.raises(ValueError, match=r"has no generation_config\.json"):
        generation_defaults(str(empty), str(tmp_path))
    (empty / "generation_config.json").write_text(json.dumps({"repetition_penalty": -1.0}))
    with pytest.raises(ValueError, match="repetition_penalty"):
        generation_defaults("auto", str(empty))


def test_stop_string_kept_with_include_stop_str_in_output() -> None:
    matcher = StopStringMatcher(["END"], include_stop=True)
    assert "".join(t for t, _ in (matcher.feed("abc E"), matcher.feed("NDxyz"))) == "abc END"
    assert matcher.matched == "END"


def test_first_token_stop_string_waits_for_min_tokens() -> None:
    def text(_: int) -> str:
        return "STOP"

    assert first_token_reason(5, SamplingParams(stop=("STOP",)), {EOS}, text) == "stop"
    assert first_token_reason(5, SamplingParams(stop=("STOP",), min_tokens=1), {EOS}, text) is None
