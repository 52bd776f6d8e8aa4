"""The requests of a run and when they arrive, all drawn from one seed.

Prompts are random token ids (sent as a token-id list to ``/v1/completions``, so every server
sees exactly ``input_len`` tokens) or random text: the decoded form of random ids when a tokenizer
is at hand, else random words. Lengths are fixed or uniform in ``[len*(1-r), len*(1+r)]``.
Arrivals are all at once, or a Poisson process: exponential gaps of mean ``1/rate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

PROMPTS_STREAM = 0
ARRIVALS_STREAM = 1
WORDS = (
    "time",
    "year",
    "people",
    "way",
    "day",
    "thing",
    "world",
    "school",
    "state",
    "water",
    "story",
    "book",
)


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: its prompt, the prompt's token count and its max_tokens."""

    prompt: list[int] | str
    prompt_len: int
    max_tokens: int


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """Inclusive bounds of a length drawn around ``length`` with ``random_range_ratio`` ``ratio``."""
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


def sample_lengths(rng: np.random.Generator, length: int, ratio: float, count: int) -> list[int]:
    low, high = length_range(length, ratio)
    return [int(n) for n in rng.integers(low, high + 1, size=count)]


def candidate_ids(vocab_size: int, tokenizer: Any = None) -> np.ndarray:
    """Token ids a random prompt may use: the vocabulary less the special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = np.array([i for i in range(vocab_size) if i not in special], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("no token id left to build prompts from")
    return ids


def _text_prompt(rng: np.random.Generator, ids: np.ndarray, length: int, tokenizer: Any) -> tuple[str, int]:
    if tokenizer is None:
        words = rng.choice(np.array(WORDS), size=length)
        return " ".join(str(w) for w in words), length
    text = tokenizer.decode([int(i) for i in rng.choice(ids, size=length)])
    encoded = tokenizer.encode(text, add_special_tokens=False)[:length]
    text = tokenizer.decode(encoded)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def sample_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    random_range_ratio: float,
    seed: int,
    *,
    token_ids: bool,
    tokenizer: Any = None,
    vocab_size: int = 0,
) -> list[BenchRequest]:
    """``num_prompts`` requests; the same arguments always give the same requests.

    Token-id prompts need a vocabulary: ``tokenizer`` (its length) or ``vocab_size``.
    """
    if tokenizer is not None and not vocab_size:
        vocab_size = len(tokenizer)
    if token_ids and vocab_size < 1:
        raise ValueError("token-id prompts need a tokenizer or a vocab size")
    rng = np.random.default_rng([seed, PROMPTS_STREAM])
    ids = candidate_ids(vocab_size, tokenizer) if vocab_size else np.zeros(0, dtype=np.int64)
    input_lens = sample_lengths(rng, input_len, random_range_ratio, num_prompts)
    output_lens = sample_lengths(rng, output_len, random_range_ratio, num_prompts)
    requests = []
    for length, max_tokens in zip(input_lens, output_lens, strict=True):
        if token_ids:
            prompt: list[int] | str = [int(i) for i in rng.choice(ids, size=length)]
            prompt_len = length
        else:
            prompt, prompt_len = _text_prompt(rng, ids, length, tokenizer)
        requests.append(BenchRequest(prompt, prompt_len, max_tokens))
    return requests


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: 0 for all at ``inf``, else a seeded Poisson process."""
    if num_requests < 1:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    rng = np.random.default_rng([seed, ARRIVALS_STREAM])
    gaps = rng.exponential(1.0 / request_rate, size=num_requests - 1)
    return [0.0, *(float(t) for t in np.cumsum(gaps))]


SHARED_PREFIX_STREAM = 2
MIXED_SHORT_STREAM = 3
MIXED_LONG_STREAM = 4


def random_ids(rng: np.random.Generator, ids: np.ndarray, length: int) -> list[int]:
    return [int(i) for i in rng.choice(ids, size=length)]


def shared_prefix_requests(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int,
    ids: np.ndarray,
    groups: int = 1,
) -> tuple[BenchRequest, list[BenchRequest]]:
    """A warm-up request and ``num_prompts`` measured ones: ``groups`` prefixes of ``prefix_len``
    token ids, request i on prefix ``i % groups`` followed by ``suffix_len`` ids of its own; with
    more than one group the measured requests go in a seeded random order. The warm-up shares the
    first prefix."""
    if groups < 1:
        raise ValueError(f"groups must be >= 1, got {groups}")
    rng = np.random.default_rng([seed, SHARED_PREFIX_STREAM])
    prefixes = [random_ids(rng, ids, prefix_len) for _ in range(groups)]
    requests = [
        BenchRequest(
            prefixes[i % groups] + random_ids(rng, ids, suffix_len), prefix_len + suffix_len, output_len
        )
        for i in range(num_prompts + 1)
    ]
    first, measured = requests[0], requests[1:]
    if groups > 1:
        measured = [measured[i] for i in rng.permutation(len(measured))]
    return first, measured


class MixedPrompts:
    """The prompts of the mixed workload, as many as its loops ask for: the i-th short or long prompt
    depends on the seed and i alone."""

    def __init__(
        self,
        ids: np.ndarray,
        seed: int,
        short: tuple[int, int],
        long: tuple[int, int],
    ) -> None:
        self._ids = ids
        self._seed = seed
        self._short = short
        self._long = long

    def short(self, index: int) -> BenchRequest:
        input_len, output_len = self._short
        rng = np.random.default_rng([self._seed, MIXED_SHORT_STREAM, index])
        return BenchRequest(random_ids(rng, self._ids, input_len), input_len, output_len)

    def long(self, index: int) -> BenchRequest:
        input_len, output_len = self._long
        rng = np.random.default_rng([self._seed, MIXED_LONG_STREAM, index])
        return BenchRequest(random_ids(rng, self._ids, input_len), input_len, output_len)
