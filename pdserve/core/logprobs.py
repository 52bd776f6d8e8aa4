"""Log-probabilities of tokens under the model's raw distribution, as an OpenAI-compatible server
returns them (``logprobs``, ``top_logprobs``, ``prompt_logprobs``).

A logprob is ``log_softmax`` (float32) of the model's logits before temperature, top-k, top-p or any
other sampling rule: the distribution the model gave, not the one the token was drawn from. For
one position it gives the token's own logprob and rank (how many tokens of the vocabulary have a
logprob at least as high, itself included) and the ``k`` most likely tokens, most likely first, ties
broken by the lower token id, so that the prefill and the decode order them alike.

The prefill computes the first generated token's from the forward that samples it, and the prompt's
(``prompt_logprobs``: position ``i`` scored by the logits of position ``i - 1``; the first prompt
token has none) from that same forward with every position's logits kept; the decode computes each
later token's from its step's forward. Requests that ask for none never reach this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Positions of a prompt scored at once: bounds the float32 ``[positions, vocab]`` working set.
PROMPT_CHUNK = 256


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there, its logprob and rank, and the ``k`` most likely tokens."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def check_count(name: str, count: int | None, vocab_size: int) -> None:
    """Raises ValueError naming ``name`` unless ``count`` is None or in [0, vocab_size]."""
    if count is not None and not 0 <= count <= vocab_size:
        raise ValueError(f"{name} must be in [0, {vocab_size}] (the vocabulary), got {count}")


def top_k(logprobs: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The ``k`` largest of one row ``[vocab]``: ids and values, highest first, ties by lower id."""
    if k <= 0:
        return [], []
    k = min(k, logprobs.numel())
    threshold = torch.topk(logprobs, k).values[-1]
    candidates = torch.nonzero(logprobs >= threshold).flatten()  # every tie at the boundary, by id
    values = logprobs[candidates]
    order = torch.sort(values, descending=True, stable=True).indices[:k]
    return candidates[order].tolist(), values[order].tolist()


def position_logprobs(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprobs:
    """``token_id``'s logprob under one row of logits ``[vocab]``, and the ``k`` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    value = logprobs[token_id]
    rank = int((logprobs >= value).sum())
    ids, values = top_k(logprobs, k)
    return TokenLogprobs(token_id, float(value), rank, tuple(ids), tuple(values))


def rows_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], counts: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Per row of ``logits`` ``[rows, vocab]``: its token's logprobs when its count is set, else None."""
    return [
        None if k is None else position_logprobs(logits[row], token_ids[row], k)
        for row, k in enumerate(counts)
    ]


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: Sequence[int], k: int) -> list[TokenLogprobs]:
    """The logprobs of prompt tokens 1..n-1, ``logits`` ``[n, vocab]`` holding each prompt position's
    logits (the last one's, which predicts the first generated token, is not used)."""
    n = len(prompt_token_ids)
    target_ids = [int(t) for t in prompt_token_ids[1:]]
    targets = torch.tensor(target_ids, dtype=torch.long, device=logits.device)
    out: list[TokenLogprobs] = []
    for start in range(0, n - 1, PROMPT_CHUNK):
        stop = min(start + PROMPT_CHUNK, n - 1)
        chunk = torch.log_softmax(logits[start:stop].float(), dim=-1)
        chosen = chunk.gather(1, targets[start:stop, None])
        ranks = (chunk >= chosen).sum(dim=-1).tolist()
        values = chosen.flatten().tolist()
        for i in range(stop - start):
            ids, tops = top_k(chunk[i], k)
            out.append(
                TokenLogprobs(target_ids[start + i], values[i], int(ranks[i]), tuple(ids), tuple(tops))
            )
    return out
