"""A prefill forward's size: fixed, or the square root of the queue's tokens times a forward's fixed
cost, within its bounds; that cost fitted from two timed forwards and measured by a real engine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefill_service.engine import PrefillEngine
from prefill_service.forward_size import ForwardSize, fixed_tokens, queued_tokens
from tests.engine_models import eager_engine_model


def test_a_forward_follows_the_queue_within_its_bounds() -> None:
    size = ForwardSize(128, 512, fixed_tokens=48.0)
    assert size.follows_queue
    assert size.tokens_for(0) == 128  # a trickle: the least size
    assert size.tokens_for(256) == 128  # sqrt(256 x 48) = 110
    assert size.tokens_for(2048) == 313  # a burst of 32 x 64 tokens
    assert size.tokens_for(1024) == 221
    assert size.tokens_for(100_000) == 512  # never more than the most


def test_a_size_whose_fixed_cost_is_unknown_or_bounds_equal_stays_at_the_least() -> None:
    assert ForwardSize(128, 512).tokens_for(100_000) == 128
    fixed = ForwardSize(300, 300, fixed_tokens=48.0)
    assert not fixed.follows_queue
    assert fixed.tokens_for(1) == fixed.tokens_for(100_000) == 300


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"least": 0, "most": 4}, r"^least must be >= 1, got 0$"),
        ({"least": 8, "most": 4}, r"^most must be >= least \(8\), got 4$"),
        ({"least": 1, "most": 4, "fixed_tokens": -1.0}, r"^fixed_tokens must be finite and >= 0, got -1.0$"),
        (
            {"least": 1, "most": 4, "fixed_tokens": math.inf},
            r"^fixed_tokens must be finite and >= 0, got inf$",
        ),
        (
            {"least": 1, "most": 4, "fixed_tokens": math.nan},
            r"^fixed_tokens must be finite and >= 0, got nan$",
        ),
    ],
)
def test_a_forward_size_refuses_bad_bounds(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ForwardSize(**kwargs)  # type: ignore[arg-type]


def test_prompts_not_begun_count_their_tokens_less_the_share_the_begun_took_from_the_cache() -> None:
    # A burst without cache hits: every prompt counts whole.
    assert queued_tokens([(64, 0, 64), (64, 0, 64)], [64] * 30) == 32 * 64
    # Prompts over one cached prefix of 1024 tokens with 32 of their own.
    begun = [(1056, 1024, 32)] * 4
    assert queued_tokens(begun, [1056] * 12) == pytest.approx(16 * 32)
    # A long prompt half run counts what it has left.
    assert queued_tokens([(2000, 0, 1000)], []) == 1000
    # Nothing begun yet: the prompts count whole.
    assert queued_tokens([], [10, 20]) == 30
    assert queued_tokens([], []) == 0


@given(
    fixed=st.floats(min_value=0.5, max_value=40.0),
    per_token=st.floats(min_value=0.01, max_value=2.0),
    small=st.integers(min_value=1, max_value=200),
    extra=st.integers(min_value=1, max_value=800),
)
def test_the_fixed_cost_of_linear_timings_is_their_intercept_over_their_slope(
    fixed: float, per_token: float, small: int, extra: int
) -> None:
    large = small + extra
    measured = fixed_tokens((small, fixed + per_token * small), (large, fixed + per_token * large), 10_000)
    assert measured == pytest.approx(fixed / per_token, rel=1e-6, abs=1e-6)


def test_the_fixed_cost_is_bounded_where_timings_are_not_linear() -> None:
    # The larger forward took no longer: all fixed cost, the largest forwards.
    assert fixed_tokens((128, 0.020), (512, 0.019), 512) == 512.0
    # Time grew faster than the tokens: no fixed part.
    assert fixed_tokens((128, 0.010), (512, 0.080), 512) == 0.0
    # Beyond the most: the most.
    assert fixed_tokens((128, 0.0130), (512, 0.0131), 512) == 512.0
    with pytest.raises(ValueError, match=r"^the large forward must have more tokens \(128 <= 128\)$"):
        fixed_tokens((128, 0.01), (128, 0.02), 512)


def test_an_engine_measures_the_fixed_cost_of_its_forwards_once(cache_dir: Path) -> None:
    m = eager_engine_model("tiny-llama", cache_dir)
    engine = PrefillEngine(m, m.device, max_batch_tokens=256, forward_size=ForwardSize(32, 256))
    try:
        size = engine.calibrate()
        assert (size.least, size.most) == (32, 256)
        # A tiny model's forward is mostly fixed cost (Python and the kernels' launches).
        assert 0 < size.fixed_tokens <= 256
        assert engine.forward_size == size
        assert engine.calibrate() == size  # known: not measured again
    finally:
        engine.close()


def test_an_engine_of_a_fixed_size_measures_nothing(cache_dir: Path) -> None:
    m = eager_engine_model("tiny-llama", cache_dir)
    fixed = PrefillEngine(m, m.device, max_batch_tokens=64, forward_size=ForwardSize(32, 32))
    given_cost = PrefillEngine(m, m.device, max_batch_tokens=64, forward_size=ForwardSize(16, 64, 3.0))
    try:
        assert fixed.calibrate() == ForwardSize(32, 32)
        assert given_cost.calibrate() == ForwardSize(16, 64, 3.0)
    finally:
        fixed.close()
        given_cost.close()
