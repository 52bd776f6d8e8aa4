"""Sampling rules and the sampler shared by prefill (first token) and decode (the rest).

Randomness is a pure function of (seed, step): the token at generation step ``s`` of a request
draws its noise from a generator seeded with ``mix(seed, s)``. The prefill process samples step
0 and the decode process continues at step 1, so a seeded request gives the same tokens whether
it runs disaggregated or in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # the text leaves special tokens out (the gateway's detokenizer)
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise ValueError(f"sampling.seed must be in [0, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("sampling.stop must not contain empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("sampling.stop_token_ids must be >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def mix_seed(seed: int, step: int) -> int:
    """The generator seed of one step of one request."""
    return (seed ^ ((step + 1) * _GOLDEN)) & _MASK64


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Samples one token id from one row of logits ``[vocab]`` at generation step ``step``."""
    if params.is_greedy:
        return int(torch.argmax(logits).item())
    if params.seed is None:
        raise ValueError("a sampled (temperature > 0) request needs a seed")
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.numel():
        keep = torch.topk(scores, params.top_k).indices
        scores = torch.full_like(scores, float("-inf")).scatter(0, keep, scores[keep])
    if params.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the top token always stays).
        drop_sorted = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    generator = torch.Generator(device="cpu").manual_seed(mix_seed(params.seed, step))
    noise = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=generator)
    return int(torch.argmax(probs / noise.to(probs.device)).item())
