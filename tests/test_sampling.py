"""Unit tests of pdserve.core.sampling, pdserve.core.finish and pdserve.rpc.sampling_proto."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

from pdserve.core.finish import EOS, LENGTH, STOP, finish_reason
from pdserve.core.sampling import SamplingParams, mix_seed, sample
from pdserve.rpc.sampling_proto import sampling_from_proto, sampling_to_proto
from pdserve.v1 import sampling_pb2


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def _counts(logits: torch.Tensor, params: dict[str, Any], n: int, by: str = "seed") -> Counter[int]:
    """Samples n times varying the seed (step 0) or the step (seed 12345)."""
    if by == "seed":
        tokens = [sample(logits, SamplingParams(seed=s, **params), 0) for s in range(n)]
    else:
        tokens = [sample(logits, SamplingParams(seed=12345, **params), s) for s in range(n)]
    return Counter(tokens)


def _chi_square(counts: Counter[int], probs: list[float], n: int) -> float:
    return sum((counts.get(i, 0) - n * p) ** 2 / (n * p) for i, p in enumerate(probs))


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"max_tokens": 0}, r"^sampling\.max_tokens must be >= 1, got 0$"),
        ({"max_tokens": -3}, r"^sampling\.max_tokens "),
        ({"temperature": -0.5}, r"^sampling\.temperature must be >= 0, got -0\.5$"),
        ({"temperature": math.nan}, r"^sampling\.temperature "),
        ({"top_p": 0.0}, r"^sampling\.top_p must be in \(0, 1\], got 0\.0$"),
        ({"top_p": -0.1}, r"^sampling\.top_p "),
        ({"top_p": 1.01}, r"^sampling\.top_p "),
        ({"top_p": math.nan}, r"^sampling\.top_p "),
        ({"top_k": -1}, r"^sampling\.top_k must be >= 0 \(0 disables it\), got -1$"),
        ({"seed": -1}, r"^sampling\.seed "),
        ({"seed": 1 << 64}, r"^sampling\.seed must be in \[0, 2\*\*64\)"),
        ({"stop": ("ok", "")}, r"^sampling\.stop must not contain empty strings$"),
        ({"stop_token_ids": (3, -1)}, r"^sampling\.stop_token_ids must be >= 0$"),
    ],
)
def test_invalid_params_name_the_field(kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_boundary_values_are_valid() -> None:
    params = SamplingParams(
        max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, seed=(1 << 64) - 1, stop_token_ids=(0,)
    )
    assert params.seed == (1 << 64) - 1
    assert SamplingParams(seed=0, top_p=1e-9).seed == 0


def test_defaults() -> None:
    params = SamplingParams()
    assert params == SamplingParams(
        max_tokens=16,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        seed=None,
        stop=(),
        stop_token_ids=(),
        ignore_eos=False,
    )
    assert not params.is_greedy


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(top_k=1).is_greedy
    assert not SamplingParams(top_k=2).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


# --- greedy --------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_the_first_index_on_ties() -> None:
    logits = torch.tensor([1.0, 3.0, -2.0, 3.0, 2.5])
    assert sample(logits, SamplingParams(temperature=0), 0) == 1
    assert sample(logits, SamplingParams(temperature=0), 99) == 1
    assert sample(torch.zeros(7), SamplingParams(temperature=0), 0) == 0
    assert sample(torch.tensor([-5.0, -1.0, -1.0]), SamplingParams(temperature=0), 0) == 1


def test_greedy_needs_no_seed_and_ignores_it() -> None:
    logits = torch.randn(100, generator=torch.Generator().manual_seed(0))
    expected = int(torch.argmax(logits))
    for seed in (None, 0, 7, (1 << 64) - 1):
        for step in (0, 1, 50):
            assert sample(logits, SamplingParams(temperature=0, seed=seed), step) == expected


def test_top_k_1_equals_greedy() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        logits = torch.randn(64, generator=g)
        expected = int(torch.argmax(logits))
        for seed in (None, 3, 11):
            assert sample(logits, SamplingParams(top_k=1, temperature=1.5, seed=seed), 4) == expected
    ties = torch.tensor([0.0, 2.0, 2.0])
    assert sample(ties, SamplingParams(top_k=1, seed=5), 0) == 1


def test_sampling_without_a_seed_is_refused() -> None:
    with pytest.raises(ValueError, match=r"needs a seed"):
        sample(torch.zeros(4), SamplingParams(temperature=1.0), 0)


# --- determinism ---------------------------------------------------------------------------------


def test_mix_seed() -> None:
    assert mix_seed(42, 3) == mix_seed(42, 3)
    assert mix_seed(42, 3) != mix_seed(42, 4)
    assert mix_seed(42, 3) != mix_seed(43, 3)
    values = {mix_seed(seed, step) for seed in range(20) for step in range(20)}
    assert len(values) == 400
    assert all(0 <= v < 1 << 64 for v in values)
    assert mix_seed(5, 0) != mix_seed(5 + (1 << 63), 0)


def test_the_same_seed_and_step_give_the_same_token() -> None:
    logits = torch.zeros(1000)  # uniform: any token is as likely as any other
    for seed in (0, 1, 99, (1 << 64) - 1):
        for step in (0, 1, 17):
            params = SamplingParams(seed=seed)
            first = sample(logits, params, step)
            assert all(sample(logits, params, step) == first for _ in range(3))
            assert sample(logits.clone(), SamplingParams(seed=seed), step) == first


def test_different_steps_and_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1000)
    by_step = [sample(logits, SamplingParams(seed=7), step) for step in range(20)]
    by_seed = [sample(logits, SamplingParams(seed=seed), 0) for seed in range(20)]
    assert len(set(by_step)) >= 15
    assert len(set(by_seed)) >= 15
    assert by_step != by_seed


def test_the_sample_does_not_depend_on_the_logits_dtype() -> None:
    logits = torch.tensor([0.5, 1.0, -0.25, 2.0, 0.0, 1.5])  # exact in bfloat16
    for seed in range(30):
        params = SamplingParams(seed=seed, temperature=0.8)
        assert sample(logits.bfloat16(), params, 2) == sample(logits, params, 2)


# --- top-k ---------------------------------------------------------------------------------------


def test_top_k_never_returns_a_token_outside_the_top_k() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    top5 = set(torch.topk(logits, 5).indices.tolist())
    counts = _counts(logits, {"top_k": 5, "temperature": 3.0}, 400)
    assert set(counts) == top5  # every sample inside, and every one of the 5 reachable
    by_step = _counts(logits, {"top_k": 5, "temperature": 3.0}, 400, by="step")
    assert set(by_step) == top5


def test_top_k_at_or_above_the_vocabulary_keeps_every_token() -> None:
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4])
    for seed in range(50):
        plain = sample(logits, SamplingParams(seed=seed), 1)
        assert sample(logits, SamplingParams(seed=seed, top_k=4), 1) == plain
        assert sample(logits, SamplingParams(seed=seed, top_k=100), 1) == plain


# --- top-p ---------------------------------------------------------------------------------------

# Token probabilities deliberately not in sorted order: sorted, they are 1 (0.5), 3 (0.25),
# 0 (0.15), 2 (0.1), with mass before each of 0, 0.5, 0.75, 0.9.
TOP_P_PROBS = [0.15, 0.5, 0.1, 0.25]


def test_a_tiny_top_p_returns_the_top_token() -> None:
    logits = _logits_of(TOP_P_PROBS)
    for seed in range(100):
        assert sample(logits, SamplingParams(seed=seed, top_p=1e-6), seed % 5) == 1


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.3, {1}),
        (0.6, {1, 3}),
        (0.75 - 1e-3, {1, 3}),
        (0.8, {1, 3, 0}),
        (0.95, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: set[int]) -> None:
    counts = _counts(_logits_of(TOP_P_PROBS), {"top_p": top_p}, 600)
    assert set(counts) == kept


def test_top_p_renormalizes_over_the_kept_tokens() -> None:
    n = 3000
    counts = _counts(_logits_of(TOP_P_PROBS), {"top_p": 0.6}, n)
    assert set(counts) == {1, 3}
    # Kept: 0.5 and 0.25 -> 2/3 and 1/3; sd of the count of token 1 is sqrt(n * 2/9) ~ 26.
    assert abs(counts[1] - n * 2 / 3) < 6 * math.sqrt(n * 2 / 9)


def test_top_k_and_top_p_together() -> None:
    # top_k=3 keeps tokens 1, 3, 0 (renormalized 0.5/0.9, 0.25/0.9, 0.15/0.9); top_p=0.7 then keeps
    # 1 and 3 (mass before 3 is 0.556 < 0.7, before 0 it is 0.833).
    counts = _counts(_logits_of(TOP_P_PROBS), {"top_k": 3, "top_p": 0.7}, 600)
    assert set(counts) == {1, 3}


# --- the distribution ----------------------------------------------------------------------------

# Chi-square with 3 degrees of freedom: P(X > 25) ~ 1.6e-5; the seeds are fixed, so not flaky.
CHI2_BOUND = 25.0


@pytest.mark.parametrize("by", ["seed", "step"])
def test_samples_follow_the_softmax_at_temperature_1(by: str) -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    counts = _counts(_logits_of(probs), {}, n, by=by)
    assert set(counts) == {0, 1, 2, 3}
    assert _chi_square(counts, probs, n) < CHI2_BOUND
    # ...and a wrong distribution is clearly rejected by the same statistic.
    assert _chi_square(counts, [0.25, 0.25, 0.25, 0.25], n) > 4 * CHI2_BOUND


def test_temperature_sharpens_the_distribution() -> None:
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    counts = _counts(_logits_of(probs), {"temperature": 0.5}, n)
    # softmax(log p / 0.5) is p**2 normalized.
    total = sum(p * p for p in probs)
    sharpened = [p * p / total for p in probs]
    assert _chi_square(counts, sharpened, n) < CHI2_BOUND
    assert _chi_square(counts, probs, n) > 4 * CHI2_BOUND


# --- finish reasons ------------------------------------------------------------------------------

EOS_IDS = frozenset({2, 9})


@pytest.mark.parametrize(
    ("token", "num_generated", "params", "expected"),
    [
        (7, 1, SamplingParams(max_tokens=3), None),
        (7, 2, SamplingParams(max_tokens=3), None),
        (7, 3, SamplingParams(max_tokens=3), LENGTH),
        (7, 4, SamplingParams(max_tokens=3), LENGTH),
        (2, 1, SamplingParams(max_tokens=3), EOS),
        (9, 1, SamplingParams(max_tokens=3), EOS),
        (2, 3, SamplingParams(max_tokens=3), EOS),  # eos before length
        (5, 1, SamplingParams(max_tokens=3, stop_token_ids=(5,)), STOP),
        (5, 3, SamplingParams(max_tokens=3, stop_token_ids=(5,)), STOP),  # stop before length
        (2, 1, SamplingParams(max_tokens=3, stop_token_ids=(2,)), EOS),  # eos before stop
        (2, 1, SamplingParams(max_tokens=3, ignore_eos=True), None),
        (2, 3, SamplingParams(max_tokens=3, ignore_eos=True), LENGTH),
        (2, 1, SamplingParams(max_tokens=3, stop_token_ids=(2,), ignore_eos=True), STOP),
        (5, 1, SamplingParams(max_tokens=1), LENGTH),
    ],
)
def test_finish_reason(token: int, num_generated: int, params: SamplingParams, expected: str | None) -> None:
    assert finish_reason(token, num_generated, params, EOS_IDS) == expected


def test_finish_reason_names_and_no_eos_ids() -> None:
    assert (EOS, STOP, LENGTH) == ("eos", "stop", "length")
    assert finish_reason(2, 1, SamplingParams(), frozenset()) is None
    assert finish_reason(2, 1, SamplingParams(), [2]) == EOS


# --- proto ---------------------------------------------------------------------------------------


def _wire(msg: sampling_pb2.SamplingParams) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams.FromString(msg.SerializeToString())


def test_an_empty_message_takes_the_defaults() -> None:
    params = sampling_from_proto(sampling_pb2.SamplingParams())
    assert params == SamplingParams()
    assert params.seed is None


def test_unset_fields_take_defaults_and_set_zeros_stay_zero() -> None:
    params = sampling_from_proto(_wire(sampling_pb2.SamplingParams(temperature=0.0, seed=0, top_k=0)))
    assert params == SamplingParams(temperature=0.0, seed=0)
    assert params.seed == 0
    assert params.max_tokens == 16
    assert params.top_p == 1.0


def test_round_trip_keeps_every_field() -> None:
    params = SamplingParams(
        max_tokens=5,
        temperature=0.5,
        top_p=0.75,
        top_k=3,
        seed=(1 << 64) - 1,
        stop=("a", "bc"),
        stop_token_ids=(1, 2),
        ignore_eos=True,
    )
    msg = _wire(sampling_to_proto(params))
    assert msg.HasField("seed")
    assert sampling_from_proto(msg) == params


def test_round_trip_keeps_the_seed_unset() -> None:
    msg = _wire(sampling_to_proto(SamplingParams(temperature=0)))
    assert not msg.HasField("seed")
    back = sampling_from_proto(msg)
    assert back.seed is None
    assert back == SamplingParams(temperature=0)
    assert sampling_from_proto(_wire(sampling_to_proto(SamplingParams()))) == SamplingParams()


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"max_tokens": 0}, r"^sampling\.max_tokens "),
        ({"temperature": -1.0}, r"^sampling\.temperature "),
        ({"top_p": 0.0}, r"^sampling\.top_p "),
        ({"top_p": 2.0}, r"^sampling\.top_p "),
        ({"top_k": -2}, r"^sampling\.top_k "),
        ({"stop": ["x", ""]}, r"^sampling\.stop "),
        ({"stop_token_ids": [-4]}, r"^sampling\.stop_token_ids "),
    ],
)
def test_invalid_messages_name_the_field(fields: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        sampling_from_proto(_wire(sampling_pb2.SamplingParams(**fields)))


def test_top_k_keeps_exactly_k_tokens_on_ties() -> None:
    logits = torch.tensor([3.0, 2.0, 2.0, -5.0])
    params = SamplingParams(temperature=1.0, top_k=2, seed=0)
    seen = {sample(logits, SamplingParams(**{**params.__dict__, "seed": s}), 0) for s in range(300)}
    assert len(seen) == 2 and 3 not in seen
