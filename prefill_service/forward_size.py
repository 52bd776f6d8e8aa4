"""How many prompt tokens one prefill forward runs together: a fixed size, or one that follows the queue.

A forward's time is a fixed part ``F`` (reading every weight once: on a CPU, bound by memory) plus a
part per token ``c`` (the arithmetic). Every prompt of a forward is answered when it ends. A queue of
``Q`` tokens run in forwards of ``S`` tokens takes ``Q / S`` forwards of ``F + c S`` each, and its
prompts get their first tokens, on average, after ``(Q / S + 1) (F + c S) / 2``: large forwards make
the first prompts wait for the others, small ones pay the fixed part again and again. That mean is
least at ``S = sqrt(Q W)``, with ``W = F / c`` the fixed part in tokens of arithmetic. So a burst
runs in forwards of a few hundred tokens and a trickle in small ones; ``S`` stays within
``[least, most]`` (most: the step's token budget).

``W`` is measured once at the prefill's warm-up (``fixed_tokens``: forwards of one row length, two
batch sizes, the fastest of a few each), so it fits the machine and the model it runs on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardSize:
    """``least``..``most`` tokens a forward; ``fixed_tokens``: ``W`` (0: not known, forwards of ``least``)."""

    least: int
    most: int
    fixed_tokens: float = 0.0

    def __post_init__(self) -> None:
        if self.least < 1:
            raise ValueError(f"least must be >= 1, got {self.least}")
        if self.most < self.least:
            raise ValueError(f"most must be >= least ({self.least}), got {self.most}")
        if not 0 <= self.fixed_tokens < math.inf:
            raise ValueError(f"fixed_tokens must be finite and >= 0, got {self.fixed_tokens}")

    @property
    def follows_queue(self) -> bool:
        """Whether the size depends on the queue (otherwise it is ``least`` = ``most``)."""
        return self.least < self.most

    def tokens_for(self, queued: float) -> int:
        """The most tokens of the next forward, for ``queued`` tokens waiting to run (its own included)."""
        best = math.sqrt(max(queued, 0.0) * self.fixed_tokens)
        return max(self.least, min(self.most, int(best)))


def queued_tokens(begun: Sequence[tuple[int, int, int]], not_begun: Sequence[int]) -> float:
    """The tokens a line has to run: its begun prompts' ``(tokens, cached, remaining)`` count their
    remaining tokens; a prompt not begun (what it takes from the prefix cache is known only then)
    counts its tokens less the share the begun ones took from the cache."""
    remaining = sum(r for _, _, r in begun)
    tokens = sum(n for n, _, _ in begun)
    uncached = 1.0 - sum(c for _, c, _ in begun) / tokens if tokens else 1.0
    return remaining + uncached * sum(not_begun)


def fixed_tokens(small: tuple[int, float], large: tuple[int, float], most: int) -> float:
    """``W`` from two forwards' ``(tokens, seconds)``, within ``[0, most]``: ``most`` where the larger
    forward took no longer (all fixed cost), 0 where the line through them has no fixed part."""
    (n_small, t_small), (n_large, t_large) = small, large
    if n_large <= n_small:
        raise ValueError(f"the large forward must have more tokens ({n_large} <= {n_small})")
    per_token = (t_large - t_small) / (n_large - n_small)
    if per_token <= 0:
        return float(most)
    fixed = t_small - per_token * n_small
    return min(float(most), max(0.0, fixed / per_token))
