"""Which prompt tokens the next prefill step runs: chunks of waiting prompts within the token budget.

A step runs one forward per group of rows that share the length of the KV they already have (their
"past": 0 for a prompt's first chunk without a prefix-cache hit, the cached prefix or the chunks
already run otherwise), so that every row of a forward continues at the same cache position and the
result is exact. A forward costs its rows times its longest chunk (rows are left-padded, as vLLM's
``--max-num-batched-tokens`` counts the batch); the step's forwards together stay within the budget.

Prompts are taken in line order, each whole if it fits. The first one that does not fit whole gets
the chunk that does (if any) and ends the step: a prompt longer than the budget runs in chunks of
it, one per step. The engine sends a prompt cut short to the back of the line (``PrefillLine``), so
prompts that arrived meanwhile run their forward between its chunks instead of after all of them.

A group may run as several forwards (``split``) of at most a given cost each, one after another, in
line order: every prompt of a forward is answered when the forward ends, so where a forward's time
grows with its tokens (a CPU) the first prompts of a burst get their first token after their own
forward rather than after the whole step's. A single chunk is never split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    index: int  # the prompt's place in the line given to ``schedule``
    num_tokens: int


@dataclass(frozen=True)
class Group:
    """Chunks run in one forward: every row has ``past`` tokens of KV already."""

    past: int
    chunks: tuple[Chunk, ...]

    @property
    def cost(self) -> int:
        return len(self.chunks) * max(c.num_tokens for c in self.chunks)


def split(group: Group, most: int) -> list[Group]:
    """``group`` as consecutive groups of at most ``most`` cost each (a chunk costing more alone)."""
    if most < 1:
        raise ValueError(f"most must be >= 1, got {most}")
    parts: list[list[Chunk]] = [[]]
    width = 0  # the longest chunk of the last part
    for chunk in group.chunks:
        part = parts[-1]
        if part and (len(part) + 1) * max(width, chunk.num_tokens) > most:
            parts.append(part := [])
            width = 0
        part.append(chunk)
        width = max(width, chunk.num_tokens)
    return [Group(group.past, tuple(part)) for part in parts]


def schedule(line: Sequence[tuple[int, int]], budget: int) -> list[Group]:
    """The groups of the next step for a line of ``(past, remaining tokens)`` prompts, in the order
    their first prompt stands in the line; empty only for an empty line."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    rows: dict[int, list[Chunk]] = {}
    longest: dict[int, int] = {}
    total = 0
    for index, (past, remaining) in enumerate(line):
        if remaining < 1:
            raise ValueError(f"prompt {index} has no token left to run")
        group = rows.setdefault(past, [])
        width = longest.get(past, 0)
        allowed = budget - total + len(group) * width  # what this group may cost with the new row
        if (len(group) + 1) * max(width, remaining) <= allowed:
            take = remaining
        else:
            take = allowed // (len(group) + 1)
            if take < max(width, 1):
                if not group:
                    del rows[past]
                break
        group.append(Chunk(index, take))
        total += (len(group)) * max(width, take) - (len(group) - 1) * width
        longest[past] = max(width, take)
        if take < remaining:
            break
    return [Group(past, tuple(chunks)) for past, chunks in rows.items() if chunks]
