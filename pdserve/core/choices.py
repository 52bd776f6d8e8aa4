"""The choices of one request (``n``): how many may be asked for and each one's sampling rules.

A request with ``n`` > 1 is prefilled once: its prompt runs forward once, and each choice samples
its first token from that forward's logits, then decodes on its own. Choice ``i`` draws from its
own random stream, seeded with ``seed + i`` (modulo 2**64, as vLLM seeds its child requests), so a
seeded request gives the same choices every time, choice 0 is the single request of that seed, and
choices of a sampled request differ. Greedy choices are all the same tokens.
"""

from __future__ import annotations

import dataclasses

from pdserve.core.sampling import MAX_CHOICES, SamplingParams

__all__ = ["MAX_CHOICES", "choice_params", "choice_seed"]

_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed``."""
    return (seed + index) & _MASK64


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling rules of one choice: a request of its own (``n`` = 1) on its own stream."""
    seed = None if params.seed is None else choice_seed(params.seed, index)
    return dataclasses.replace(params, n=1, seed=seed)
