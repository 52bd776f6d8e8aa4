"""Unit tests of pdserve.core.limits: what a request may ask of a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import LlamaConfig

from pdserve.core.limits import ModelLimits
from pdserve.core.sampling import SamplingParams

LIMITS = ModelLimits(vocab_size=100, max_model_len=10, eos_token_ids=frozenset({2}))


def test_a_request_that_fits_passes() -> None:
    LIMITS.check_request([0, 99, 5], SamplingParams(max_tokens=7, stop_token_ids=(0, 99)))
    LIMITS.check_request([1] * 9, SamplingParams(max_tokens=1))  # exactly the context


def test_an_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^prompt must not be empty$"):
        LIMITS.check_request([], SamplingParams())


@pytest.mark.parametrize(
    ("prompt", "pattern"),
    [
        ([1, 100], r"^prompt_token_ids\[1\] = 100 is outside the vocabulary \[0, 100\)$"),
        ([-1, 5], r"^prompt_token_ids\[0\] = -1 is outside the vocabulary \[0, 100\)$"),
        ([1, 2, 3, 4, 12345], r"^prompt_token_ids\[4\] = 12345 "),
    ],
)
def test_an_id_outside_the_vocabulary_is_named_with_its_index(prompt: list[int], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        LIMITS.check_request(prompt, SamplingParams(max_tokens=1))


def test_the_first_bad_id_is_reported() -> None:
    with pytest.raises(ValueError, match=r"^prompt_token_ids\[1\] = 200 "):
        LIMITS.check_request([0, 200, 300], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("num_prompt", [10, 11, 50])
def test_a_prompt_at_or_over_the_context_is_refused(num_prompt: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^prompt has {num_prompt} tokens; the model's context is 10 \(the prompt must leave room",
    ):
        LIMITS.check_request([1] * num_prompt, SamplingParams(max_tokens=1))


@pytest.mark.parametrize(("num_prompt", "max_tokens"), [(9, 2), (1, 10), (5, 16)])
def test_max_tokens_beyond_the_context_is_refused(num_prompt: int, max_tokens: int) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^sampling\.max_tokens = {max_tokens} is beyond the context: prompt \({num_prompt}\) "
        r"\+ max_tokens must be <= 10$",
    ):
        LIMITS.check_request([1] * num_prompt, SamplingParams(max_tokens=max_tokens))


def test_stop_token_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"^sampling\.stop_token_ids has 100, outside the vocabulary \[0, 100\)$"
    ):
        LIMITS.check_request([1], SamplingParams(max_tokens=1, stop_token_ids=(5, 100)))


def test_from_config_takes_the_model_context() -> None:
    config = LlamaConfig(vocab_size=64, max_position_embeddings=32)
    eos = frozenset({1, 3})
    assert ModelLimits.from_config(config, 0, eos) == ModelLimits(64, 32, eos)


def test_from_config_caps_the_context_with_max_model_len() -> None:
    config = LlamaConfig(vocab_size=64, max_position_embeddings=32)
    assert ModelLimits.from_config(config, 16, frozenset()).max_model_len == 16
    assert ModelLimits.from_config(config, 64, frozenset()).max_model_len == 32


def test_from_config_without_max_position_embeddings() -> None:
    config = SimpleNamespace(vocab_size=50)
    assert ModelLimits.from_config(config, 20, frozenset({0})) == ModelLimits(50, 20, frozenset({0}))
    with pytest.raises(ValueError, match=r"no max_position_embeddings; set max_model_len"):
        ModelLimits.from_config(config, 0, frozenset())


def test_from_config_reads_the_text_config() -> None:
    text = SimpleNamespace(vocab_size=70, max_position_embeddings=40)
    outer = SimpleNamespace(vocab_size=1, max_position_embeddings=1, get_text_config=lambda: text)
    assert ModelLimits.from_config(outer, 0, frozenset()) == ModelLimits(70, 40, frozenset())
