"""The one shared prefix of a decode batch context, and how much of a request's KV equals it.

The prefix is the KV of one request (the first to join when no running request shared the one
before), kept twice: laid out as a batch context row is (``[positions, heads, width]`` per layer's
keys then values), to compare joining requests with, and head-major with one spare position
(``keys``/``values``, ``[heads, positions + 1, width]``), as ``shared_prefix_attention`` reads it. A
joining request shares the first positions whose KV equals the prefix's bit for bit in every layer
(``measure``): its leading blocks whose pool keys (``KvPool.key_of``) equal the prefix's blocks'
hold the same KV by construction and are not read; the positions after them are read from its pool
blocks into a scratch buffer kept with the prefix, so that measuring allocates nothing: the first
block's positions alone first (a request over another prompt differs there, and the rest is not
read), then the rest. A full block found equal so keeps its key as an alias of the prefix's block at
that place (a key names the same KV for good): the next request with it, from another prefill that
computed the same prompt, say, is not read again. The buffers are kept when the prefix changes and
only grow.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode_service.kv_pool import BlockKey, KvPool
from pdserve.model.compiled_forward import static_dims

ROUND = 64  # the buffers' positions are allocated in multiples of this
MAX_ALIASES = 1 << 16  # blocks of other keys known to equal the prefix's; forgotten all at once past this


class ContextPrefix:
    def __init__(self, pool: KvPool) -> None:
        self._pool = pool
        self.length = 0  # positions of the prefix (0: none)
        self._rows: list[torch.Tensor] = []  # per layer's keys, then values: [capacity, heads, width]
        self._heads_first: list[torch.Tensor] = []  # the same, [heads, capacity + 1, width]
        self._scratch: list[torch.Tensor] = []  # a joining request's positions, read to compare
        self._keys: list[BlockKey] = []  # pool keys of the prefix's leading full blocks
        self._aliases: set[tuple[BlockKey, int]] = set()  # (key, index): that block equals the prefix's there
        self.num_positions_read = 0  # positions of joining requests read to compare with the prefix

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer ``[heads, positions, width]`` views of the prefix's keys (never a whole tensor: a
        step's slice has the strides of every other step's, for compiled code)."""
        return [t[:, : self.length] for t in self._heads_first[: self._pool.layout.num_layers]]

    @property
    def values(self) -> list[torch.Tensor]:
        return [t[:, : self.length] for t in self._heads_first[self._pool.layout.num_layers :]]

    def adopt(self, blocks: Sequence[int], length: int) -> None:
        """The ``length`` first positions of the request owning ``blocks`` become the prefix."""
        self._reserve(length)
        self._keys = []
        self._aliases = set()
        for block in blocks[: length // self._pool.block_size]:
            key = self._pool.key_of(block)
            if key is None:
                break
            self._keys.append(key)
        slots = self._pool.slots(blocks, 0, length)
        for pool_t, rows, heads_first in zip(
            self._pool_tensors(), self._rows, self._heads_first, strict=True
        ):
            torch.index_select(pool_t, 0, slots, out=rows[:length])
            heads_first[:, :length].copy_(rows[:length].transpose(0, 1))
        self.length = length

    def measure(self, blocks: Sequence[int], length: int, at_least: int) -> int:
        """How many first positions of the request owning ``blocks`` (of ``length``) equal the prefix;
        0 when fewer than ``at_least``."""
        same = min(length, self.length)
        if same < at_least:
            return 0
        known = start = self._known(blocks, same)
        while start < same:  # the first block's positions, then the rest
            stop = min(same, start + self._pool.block_size) if start == known else same
            first = self._equal_until(blocks, start, stop)
            if first < stop:
                same = first
                break
            start = stop
        if same < at_least:
            return 0
        self._alias(blocks, known, same)
        return same

    def _known(self, blocks: Sequence[int], limit: int) -> int:
        """The first positions (at most ``limit``) in leading blocks whose keys are the prefix's, or
        aliases of the prefix's block at the same place."""
        size = self._pool.block_size
        count = 0
        for index, block in enumerate(blocks[: limit // size]):
            key = self._pool.key_of(block)
            if key is None:
                break
            if key != self._key_at(index) and (key, index) not in self._aliases:
                break
            count += 1
        return count * size

    def _equal_until(self, blocks: Sequence[int], start: int, stop: int) -> int:
        """The first position in [start, stop) where the request's KV differs from the prefix's in
        some layer; ``stop`` where none does."""
        count = stop - start
        self.num_positions_read += count
        slots = self._pool.slots(blocks, start, count)
        for pool_t, rows, scratch in zip(self._pool_tensors(), self._rows, self._scratch, strict=True):
            mine = torch.index_select(pool_t, 0, slots[:count], out=scratch[:count])
            theirs = rows[start : start + count]
            if not torch.equal(mine, theirs):  # the first that differs:
                count = int((mine != theirs).flatten(1).any(1).nonzero()[0, 0])
                if count == 0:
                    break
        return start + count

    def _alias(self, blocks: Sequence[int], known: int, same: int) -> None:
        """Remembers the keys of the request's full blocks in [known, same), found equal to the
        prefix's by their KV."""
        size = self._pool.block_size
        for index in range(known // size, same // size):
            key = self._pool.key_of(blocks[index])
            if key is None or key == self._key_at(index):
                continue
            if len(self._aliases) >= MAX_ALIASES:
                self._aliases = set()
            self._aliases.add((key, index))

    def _key_at(self, index: int) -> BlockKey | None:
        """The pool key of the prefix's block ``index``, None past its keyed leading blocks."""
        return self._keys[index] if index < len(self._keys) else None

    def fill(self, targets: Sequence[torch.Tensor], start: int, stop: int) -> None:
        """Copies the prefix's positions [start, stop) into the first ``stop - start`` positions of
        every row of ``targets`` (per layer's keys, then values: ``[rows, positions, heads, width]``)."""
        for target, rows in zip(targets, self._rows, strict=True):
            target[:, : stop - start] = rows[start:stop]

    def forget(self) -> None:
        """No prefix any more; the buffers stay for the next one."""
        self.length = 0
        self._keys = []
        self._aliases = set()

    def release(self) -> None:
        """No prefix, and its memory given back."""
        self.forget()
        self._rows, self._heads_first, self._scratch = [], [], []

    def _pool_tensors(self) -> list[torch.Tensor]:
        return [*self._pool.keys, *self._pool.values]

    def _reserve(self, length: int) -> None:
        if self._rows and self._rows[0].shape[0] >= length:
            return
        capacity = -(-length // ROUND) * ROUND
        layout, device = self._pool.layout, self._pool.device
        shapes = (*layout.keys, *layout.values)
        self._rows = [torch.empty((capacity, h, w), dtype=layout.dtype, device=device) for h, w in shapes]
        self._scratch = [torch.empty_like(t) for t in self._rows]
        # Heads and width: the model's, constants of a compiled step (see ``static_dims``).
        self._heads_first = [
            static_dims(torch.empty((h, capacity + 1, w), dtype=layout.dtype, device=device), 0, 2)
            for h, w in shapes
        ]
