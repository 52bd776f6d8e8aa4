"""Sampling rules and the sampler shared by prefill (first token) and decode (the rest).

Randomness is a pure function of (seed, step): the token at generation step ``s`` of a request
draws its noise from a generator seeded with ``mix(seed, s)``. The prefill process samples step
0 and the decode process continues at step 1, so a seeded request gives the same tokens whether
it runs disaggregated or in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.core.structured_output import StructuredOutput

_GOLDEN = 0x9E3779B97F4A7C15
MAX_CHOICES = 128  # the most choices (``n``) of one request any service takes
MAX_BAD_WORDS = 128  # the most token sequences of one request's bad words (vLLM's default bound)
MAX_BAD_WORDS_TOKENS = 4096  # the most tokens of those sequences together (each step reads them)
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
    n: int = 1  # choices of the request (``pdserve.core.choices``)
    # Log-probabilities to return (``pdserve.core.logprobs``): None returns none; a count returns
    # each generated token's logprob and that many most likely tokens (prompt_logprobs: each
    # prompt token's after the first).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None  # what the output must match
    # vLLM's meaning (``pdserve.core.logits_processing`` applies them to the logits before sampling).
    presence_penalty: float = 0.0  # subtracted once from every token the output holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = (
        1.0  # divides (multiplies, when negative) the logits of prompt and output tokens
    )
    min_p: float = 0.0  # drops tokens below min_p times the top token's probability
    min_tokens: int = (
        0  # end-of-sequence and stop tokens are masked (stop strings unchecked) before this many
    )
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # when set, only these tokens may be sampled
    # vLLM's bad_words: the words as given (resolved by the gateway into their token sequences)...
    bad_words: tuple[str, ...] = ()
    # ...and those sequences: a sequence's last token is masked where the output ends with the rest.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False  # the text keeps the stop string (or stop token) that ended it
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
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"sampling.n must be in [1, {MAX_CHOICES}], got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None and count < 0:
                raise ValueError(f"sampling.{name} must be >= 0 (unset: none), got {count}")
        check_logits_fields(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's tokens (the penalties, the bad words)."""
        return self.has_penalties or bool(self.bad_words_token_ids)

    @property
    def has_processors(self) -> bool:
        """Whether any logits processor applies (else sampling takes the fast path)."""
        return (
            self.needs_history
            or self.min_tokens > 0
            or bool(self.logit_bias)
            or bool(self.allowed_token_ids)
            or (self.min_p > 0 and not self.is_greedy)
        )


def check_logits_fields(params: SamplingParams) -> None:
    """The ranges vLLM allows for the logits processors' fields (ValueError names the field)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2 <= value <= 2:  # also rejects NaN
            raise ValueError(f"sampling.{name} must be in [-2, 2], got {value}")
    if not 0 < params.repetition_penalty < float("inf"):
        raise ValueError(
            f"sampling.repetition_penalty must be a finite number > 0, got {params.repetition_penalty}"
        )
    if not 0 <= params.min_p <= 1:
        raise ValueError(f"sampling.min_p must be in [0, 1], got {params.min_p}")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise ValueError(
            f"sampling.min_tokens must be in [0, max_tokens = {params.max_tokens}], got {params.min_tokens}"
        )
    ids = [token for token, _ in params.logit_bias]
    if len(set(ids)) != len(ids):
        raise ValueError("sampling.logit_bias must name each token id once")
    for token, bias in params.logit_bias:
        if token < 0:
            raise ValueError(f"sampling.logit_bias has token id {token}; ids are >= 0")
        if not -100 <= bias <= 100:
            raise ValueError(f"sampling.logit_bias[{token}] must be in [-100, 100], got {bias}")
    if any(t < 0 for t in params.allowed_token_ids):
        raise ValueError("sampling.allowed_token_ids must be >= 0")
    if any(not word for word in params.bad_words):
        raise ValueError("sampling.bad_words must not contain empty strings")
    if len(params.bad_words_token_ids) > MAX_BAD_WORDS:
        raise ValueError(
            f"sampling.bad_words are {len(params.bad_words_token_ids)} token sequences; at most "
            f"{MAX_BAD_WORDS} are allowed"
        )
    total = sum(len(sequence) for sequence in params.bad_words_token_ids)
    if total > MAX_BAD_WORDS_TOKENS:
        raise ValueError(
            f"sampling.bad_words are {total} tokens together; at most {MAX_BAD_WORDS_TOKENS} are allowed"
        )
    for sequence in params.bad_words_token_ids:
        if not sequence or any(t < 0 for t in sequence):
            raise ValueError("sampling.bad_words_token_ids must hold non-empty sequences of ids >= 0")


def mix_seed(seed: int, step: int) -> int:
    """The generator seed of one step of one request."""
    return (seed ^ ((step + 1) * _GOLDEN)) & _MASK64


def min_p_filter(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """``scores`` with every token less likely than ``min_p`` times the top token masked."""
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < probs.max(dim=-1, keepdim=True).values * min_p, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Samples one token id from one row of logits ``[vocab]`` at generation step ``step``."""
    if params.is_greedy:
        return int(torch.argmax(logits).item())
    if params.seed is None:
        raise ValueError("a sampled (temperature > 0) request needs a seed")
    scores = logits.float() / params.temperature
    if params.min_p > 0:  # after temperature, before top-k and top-p, as vLLM
        scores = min_p_filter(scores, params.min_p)
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
