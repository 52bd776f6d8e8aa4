"""The running rows' KV laid out for a step in two batch contexts: the short rows' and the long rows'.

One batch context (``step_cache.BatchContext``) is a rectangle: every row has room for the longest
row's positions and a step reads that many for every row. When a few rows are much longer than the
others (a long prompt decoding next to short chats), both the memory and the reads of the short
rows would follow the long ones; ``split_rows`` (``pdserve.model.ragged_attention``) tells which
rows to take apart, and these live in a second batch context, the long tier. A step runs the short
rows first, then the long ones, and attends to each tier in its own call.

Which rows are long is decided again only when the running set changes (a row joins or leaves):
every row grows by one position a step, so a split stays right between changes, and rows move
between tiers only then (a move is a leave from one context and a join of the other, copied from
the row's blocks in the pool, which every step keeps up to date). Without a split every row is in
the short tier, and the long tier keeps its memory for the next split, until ``release``. The short
tier's rows may leave a prefix they share to its shared prefix (``step_cache``), but not while a
split holds: the split's attention reads whole rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from decode_service.kv_pool import KvPool
from decode_service.step_cache import BatchContext
from pdserve.model.ragged_attention import split_rows


class BatchTiers:
    def __init__(
        self, pool: KvPool, max_rows: int, max_positions: int = 0, split: bool = False, share: bool = False
    ) -> None:
        """``split``: whether long rows may be taken apart (the model attends to the tiers apart);
        ``share``: whether the short rows may leave a prefix they share to the short tier's shared
        prefix (the model attends to it apart), when no row is long."""
        self.short = BatchContext(pool, max_rows, max_positions, share)
        self.long = BatchContext(pool, max_rows, max_positions)
        self._split = split
        self._serials: frozenset[int] = frozenset()  # the running set the split was decided for
        self._long: frozenset[int] = frozenset()  # its long rows

    @property
    def num_short(self) -> int:
        return len(self.short.serials)

    @property
    def num_long(self) -> int:
        return len(self.long.serials)

    def sync(
        self, serials: Sequence[int], blocks: Sequence[Sequence[int]], lengths: Sequence[int]
    ) -> list[int]:
        """Makes the tiers hold exactly the requests ``serials`` (with their ``blocks`` and ``lengths``
        cached positions, room for one more each); returns the step's row order as indices into
        ``serials``: the short tier's rows, then the long tier's."""
        running = frozenset(serials)
        if running != self._serials:
            self._serials = running
            split = split_rows([n + 1 for n in lengths]) if self._split else None
            self._long = frozenset(serials[i] for i in split[1]) if split is not None else frozenset()
        short = [i for i, serial in enumerate(serials) if serial not in self._long]
        long = [i for i, serial in enumerate(serials) if serial in self._long]
        order = [short[j] for j in _sync(self.short, short, serials, blocks, lengths, share=not long)]
        return order + [long[j] for j in _sync(self.long, long, serials, blocks, lengths)]

    def clear(self) -> None:
        """Forgets every row; the memory stays."""
        self.short.clear()
        self.long.clear()
        self._serials = self._long = frozenset()

    def release(self) -> None:
        """Forgets every row and gives the memory back, but for the short tier's reservation."""
        self.clear()
        self.short.release()
        self.long.release()

    @property
    def num_bytes(self) -> int:
        return self.short.num_bytes + self.long.num_bytes


def _sync(
    context: BatchContext,
    rows: list[int],
    serials: Sequence[int],
    blocks: Sequence[Sequence[int]],
    lengths: Sequence[int],
    share: bool = True,
) -> list[int]:
    """``context.sync`` for the requests ``rows`` (indices into the others); an empty tier forgets
    its rows and keeps its memory."""
    if not rows:
        context.clear()
        return []
    picked = [serials[i] for i in rows], [blocks[i] for i in rows], [lengths[i] for i in rows]
    return context.sync(*picked, share=share)
