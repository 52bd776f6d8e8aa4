"""The first token of each choice of a request, sampled from one row of the prompt's forward.

A request with ``n`` choices runs its prompt forward once; every choice samples its first token
from that forward's logits on its own random stream (``pdserve.core.choices``), and the finish rules
judge each one alone. The prompt's KV is packed once when at least one choice goes on to decode
(``continues``); a choice complete at its first token takes nothing from it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from pdserve.core.choices import choice_params
from pdserve.core.finish import first_token_reason
from pdserve.core.grammar import GrammarState
from pdserve.core.sampling import SamplingParams, sample


@dataclass(frozen=True)
class FirstToken:
    """One choice's first token and, when the choice is complete at it, why."""

    token_id: int
    finish_reason: str | None


def first_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    step: int,
    eos_token_ids: Collection[int],
    token_text: Callable[[int], str],
) -> tuple[FirstToken, ...]:
    """Every choice's token at ``step`` from one row of logits ``[vocab]``, in index order."""
    tokens = []
    for index in range(params.n):
        choice = choice_params(params, index) if params.n > 1 else params
        token = sample(logits, choice, step=step)
        tokens.append(FirstToken(token, first_token_reason(token, choice, eos_token_ids, token_text, step)))
    return tuple(tokens)


def continues(tokens: tuple[FirstToken, ...]) -> bool:
    """Whether any choice goes on to decode (its KV is then parked)."""
    return any(token.finish_reason is None for token in tokens)


def with_grammar(tokens: tuple[FirstToken, ...], grammar: GrammarState) -> tuple[FirstToken, ...]:
    """``tokens`` with their finish reasons under the request's structured output: each choice
    advances its own copy of ``grammar`` (whose mask its token was sampled under) by its token."""
    finished = []
    for index, token in enumerate(tokens):
        state = grammar if index == len(tokens) - 1 else grammar.copy()
        state.advance(token.token_id)
        finished.append(FirstToken(token.token_id, state.finish_reason(token.finish_reason)))
    return tuple(finished)
