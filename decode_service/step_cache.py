"""The transformers Cache of one decode step over the paged pool.

The pool (``kv_pool``) is the home of every request's KV. For the step's forward the running rows'
keys and values are also laid out as ``[rows, capacity, heads, width]`` (the batch context), one
row per running request, kept across steps: each step writes its new token into both the pool and
the batch context, in place. A request that joins takes a free row at the end and only its own KV
is copied in (from its blocks); a request that leaves hands its row to the last row, whose KV is
the only one to move. Every row is copied only when the context grows, which happens geometrically
(rows doubled, up to the engine's most running requests; positions by half, in multiples of
``CAPACITY_STEP``, up to the longest context a row can hold). A step's attention reads the first
``length`` positions of the live rows, the longest live context: its cost follows the live context,
not a fixed maximum. Shorter rows are masked by the step's attention mask. The context keeps its
memory when the running set empties, so that the next burst of requests does not pay for growing
it again, until ``release`` (the engine calls it once nothing has run for ``--context-idle-s``):
a burst's memory is given back, down to what ``reserve`` set aside.

Fresh memory costs its page faults when first written, and on a virtual machine these are slow
(measured on the 2-core CPU machine: 20-490 ms to allocate and zero the 50 MB of 32 rows of the
reference model, against 1-3 ms for memory touched before), so a context that grows in the middle
of a burst stalls every running request. ``reserve`` allocates and touches a context up front (the
engine does at start-up): a burst within it never grows.

The context also keeps one shared prefix (``context_prefix.ContextPrefix``): the KV of the first
request that joined when no live row shared one, and for each live row the number of its first
positions whose KV equals it, bit for bit, in every layer (measured from the pool when the row
joins). The rows do not hold the ``base`` first positions every live row shares (at least
``MIN_SHARED_TOKENS``, and at most each row's cached positions but one): row position ``i`` is the
request's position ``base + i``, and a step attends to the prefix's first ``base`` positions once for
all rows (``pdserve.model.shared_prefix_attention``) and to each row's own positions after them.
Requests over a long common prompt thus cost their own positions only, in copies and in memory.
When a joining row shares less, the base goes down and every row takes the positions between from
the prefix; when the rows that shared less leave, it goes up and every row drops them. A context
that does not share (``share=False``: the model attends over whole rows) keeps base 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from decode_service.context_prefix import ContextPrefix
from decode_service.kv_pool import KvPool
from pdserve.model.compiled_forward import static_dims

CAPACITY_STEP = 64  # the batch context grows by at least this many positions at a time
MIN_ROWS = 8  # rows of a batch context when first allocated
MIN_SHARED_TOKENS = 16  # a shorter shared prefix is attended row by row


class BatchContext:
    """The running rows' KV, contiguous per layer, row ``i`` holding ``serials[i]``'s positions from
    ``base`` on."""

    def __init__(self, pool: KvPool, max_rows: int, max_positions: int = 0, share: bool = False) -> None:
        """``max_positions``: the most positions a row can hold (the model's context length; 0: no
        bound), beyond which the context never grows; ``share``: whether rows may leave a shared
        prefix to the prefix (steps then attend to it apart)."""
        if max_rows < 1:
            raise ValueError(f"a batch context needs rows, got max_rows={max_rows}")
        if max_positions < 0:
            raise ValueError(f"max_positions must be >= 0, got {max_positions}")
        self._pool = pool
        self._max_rows = max_rows
        self._max_capacity = _round_up(max_positions + 1) if max_positions else 0
        self._share = share
        self._reserved = (0, 0)  # rows and capacity that release() keeps
        self.serials: list[int] = []  # the request (engine serial) of each live row, in row order
        self.capacity = 0  # positions per row
        self.keys: list[torch.Tensor] = []  # per layer [allocated rows, capacity, heads, width]
        self.values: list[torch.Tensor] = []
        self.num_rows_copied = 0  # rows copied in: joins, moves on leave, and every row at a growth
        self.num_growths = 0
        self.prefix = ContextPrefix(pool)
        self.base = 0  # positions of every row held by the prefix alone
        self.shared_lengths: list[int] = []  # per live row: its first positions equal to the prefix

    def shared_length(self) -> int:
        """Positions of every live row a step attends to in the shared prefix (the base)."""
        return self.base

    @property
    def allocated_rows(self) -> int:
        return int(self.keys[0].shape[0]) if self.keys else 0

    def sync(
        self,
        serials: Sequence[int],
        blocks: Sequence[Sequence[int]],
        lengths: Sequence[int],
        share: bool = True,
    ) -> list[int]:
        """Makes the context hold exactly the requests ``serials`` (with their ``blocks`` and
        ``lengths`` cached positions), room for one more position each; returns the row order as
        indices into ``serials``: row ``i`` is request ``serials[order[i]]``. ``share=False``: this
        time no row leaves positions to the prefix (base 0)."""
        index = {serial: i for i, serial in enumerate(serials)}
        self._drop_left(index)
        present = set(self.serials)
        joining = [i for i, serial in enumerate(serials) if serial not in present]
        joined: list[int] = []
        for i in joining:
            some = any(self.shared_lengths) or any(joined)
            joined.append(self._measure(blocks[i], lengths[i], some))
        base = self._base([*self.shared_lengths, *joined], lengths) if share and self._share else 0
        if base > self.base:
            self._rebase(base)
        needed = max(lengths) + 1 - base
        if needed > self.capacity or len(serials) > self.allocated_rows:
            self._grow(len(serials), needed)
        if base < self.base:
            self._rebase(base)
        for i, shared in zip(joining, joined, strict=True):
            self._join(blocks[i], lengths[i])
            self.serials.append(serials[i])
            self.shared_lengths.append(shared)
        return [index[serial] for serial in self.serials]

    def _base(self, shared: Sequence[int], lengths: Sequence[int]) -> int:
        """The positions every row leaves to the prefix: what they all share, but at most each one's
        cached positions but one (a row holds two positions at least, the new one included); 0 when
        fewer than ``MIN_SHARED_TOKENS``."""
        base = min(*shared, min(lengths) - 1)
        return base if base >= MIN_SHARED_TOKENS else 0

    def _measure(self, blocks: Sequence[int], length: int, shared: bool) -> int:
        """The positions a joining request shares with the prefix; when no row shares it
        (``shared``: some row does), the request's KV becomes the prefix."""
        if not self._share:
            return 0
        if not shared:
            self.prefix.adopt(blocks, length)
            return length
        return self.prefix.measure(blocks, length, MIN_SHARED_TOKENS)

    def _rebase(self, base: int) -> None:
        """Moves every live row's positions so that row position 0 is ``base``: the positions from
        ``base`` up to the old base come from the prefix, or those from the old base up to ``base`` go."""
        live, shift = len(self.serials), base - self.base
        tensors = (*self.keys, *self.values)
        if live and shift > 0:
            for t in tensors:
                t[:live, : self.capacity - shift] = t[:live, shift:].clone()
        elif live and shift < 0:
            for t in tensors:
                t[:live, -shift:] = t[:live, : self.capacity + shift].clone()
            self.prefix.fill([t[:live] for t in tensors], base, self.base)
        self.base = base

    def _drop_left(self, live: dict[int, int]) -> None:
        """Forgets the rows of requests not in ``live``: each hole is taken by the last live row."""
        row = 0
        while row < len(self.serials):
            if self.serials[row] in live:
                row += 1
                continue
            while self.serials[-1] not in live:  # rows left at the end go without a move
                self.serials.pop()
                self.shared_lengths.pop()
                if row == len(self.serials):
                    return
            last = len(self.serials) - 1
            for t in (*self.keys, *self.values):
                t[row].copy_(t[last])
            self.serials[row] = self.serials.pop()
            self.shared_lengths[row] = self.shared_lengths.pop()
            self.num_rows_copied += 1

    def reserve(self, rows: int, positions: int) -> None:
        """Allocates and touches the context for at least ``rows`` rows (at most the engine's most
        running requests) of ``positions`` positions now, and keeps that much from then on."""
        rows = min(rows, self._max_rows)
        capacity = _round_up(positions)
        if self._max_capacity:
            capacity = min(capacity, self._max_capacity)
        if rows > self.allocated_rows or capacity > self.capacity:
            self._allocate(max(rows, self.allocated_rows), max(capacity, self.capacity))
        self._reserved = (self.allocated_rows, self.capacity)

    def _grow(self, rows: int, positions: int) -> None:
        """Reallocates for ``rows`` rows of ``positions``: rows doubled and positions by half when
        short, but never more than twice what is needed in either (a context that grew long for a few
        rows does not keep that length for many, nor a reservation's rows for long ones)."""
        new_rows = self.allocated_rows
        if rows > new_rows:  # rows beyond --max-running would never be used
            new_rows = max(rows, min(2 * new_rows, self._max_rows), min(MIN_ROWS, self._max_rows))
        capacity = self.capacity
        if positions > capacity:  # room for the step after too, and by half the context at least
            capacity = max(_round_up(positions + CAPACITY_STEP), _round_up(capacity + capacity // 2))
            if self._max_capacity:
                capacity = max(min(capacity, self._max_capacity), _round_up(positions))
        new_rows = min(new_rows, max(2 * rows, min(MIN_ROWS, self._max_rows)))
        capacity = min(capacity, max(_round_up(2 * positions), _round_up(positions + CAPACITY_STEP)))
        self._allocate(new_rows, capacity)

    def _allocate(self, new_rows: int, capacity: int) -> None:
        """Moves the context to zeroed memory of ``new_rows`` rows of ``capacity`` positions, every
        live row with it."""
        pool = self._pool
        live = len(self.serials)

        def grown(old: list[torch.Tensor], shapes: tuple[tuple[int, int], ...]) -> list[torch.Tensor]:
            new = [  # heads and width: the model's, constants of a compiled step (see ``static_dims``)
                static_dims(
                    torch.zeros(
                        (new_rows, capacity, heads, width), dtype=pool.layout.dtype, device=pool.device
                    ),
                    2,
                    3,
                )
                for heads, width in shapes
            ]
            kept = min(self.capacity, capacity)  # a shorter context still holds every live row
            for new_t, old_t in zip(new, old, strict=False):  # no old tensors at the first growth
                new_t[:live, :kept] = old_t[:live, :kept]
            return new

        self.keys = grown(self.keys, pool.layout.keys)
        self.values = grown(self.values, pool.layout.values)
        self.capacity = capacity
        self.num_rows_copied += live
        self.num_growths += 1

    def _join(self, blocks: Sequence[int], length: int) -> None:
        """Copies a joining request's cached positions after the base from its blocks into the next row."""
        row, own = len(self.serials), length - self.base
        slots = self._pool.slots(blocks, self.base, own)
        for pool_t, t in zip((*self._pool.keys, *self._pool.values), (*self.keys, *self.values), strict=True):
            torch.index_select(pool_t, 0, slots, out=t[row, :own])
        self.num_rows_copied += 1

    def clear(self) -> None:
        """Forgets every row; the memory stays for the next ones (growing is what costs)."""
        self.serials = []
        self.shared_lengths = []
        self.base = 0
        self.prefix.forget()

    def release(self) -> None:
        """Forgets every row and gives the memory back, but for the reservation (allocated anew when
        the context grew past it); the next step beyond it allocates anew."""
        self.clear()
        self.prefix.release()
        if (self.allocated_rows, self.capacity) == self._reserved:
            return
        self.keys = []
        self.values = []
        self.capacity = 0
        if self._reserved != (0, 0):
            self._allocate(*self._reserved)

    @property
    def num_bytes(self) -> int:
        """Memory the context holds."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))


def _round_up(positions: int) -> int:
    """``positions`` rounded up to a multiple of ``CAPACITY_STEP``."""
    return -(-positions // CAPACITY_STEP) * CAPACITY_STEP


@dataclass(frozen=True)
class LongTier:
    """One layer of a step's long rows: their rows of the long tier's batch context ``[rows,
    capacity, heads, width]``, their indices in it and in the step, each one's new position, and the
    positions they attend over."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: torch.Tensor
    steps: torch.Tensor
    lengths: torch.Tensor
    length: int


class StepLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(
        self,
        pool_keys: torch.Tensor,
        pool_values: torch.Tensor,
        batch_keys: torch.Tensor,
        batch_values: torch.Tensor,
        write_slots: torch.Tensor,
        lengths: torch.Tensor,
        length: int,
        start: int = 0,
        long: LongTier | None = None,
    ) -> None:
        """``batch_keys``/``batch_values``: the step's first rows' (the short tier), whose position 0
        is the request's position ``start`` (the positions before it are a shared prefix the step
        attends to apart); ``lengths``: each one's new position in its row (its position less
        ``start``); ``length``: the positions they attend over, ``start`` included; ``long``: where
        the step's other rows (the long tier, attended apart) take their new positions."""
        super().__init__()
        self._pool_keys = pool_keys
        self._pool_values = pool_values
        # Views of the batch context: compiled code sees their sizes apart from their base's.
        self._batch_keys = static_dims(batch_keys, 2, 3)
        self._batch_values = static_dims(batch_values, 2, 3)
        if long is not None:
            static_dims(long.keys, 2, 3)
            static_dims(long.values, 2, 3)
        self._write = write_slots  # [batch] pool slot of each row's new position
        self._rows = torch.arange(len(lengths), device=lengths.device)
        self._lengths = lengths  # [short rows] each row's new position in its row
        self._length = length
        self._start = start
        self._long = long
        self.long_keys: torch.Tensor | None = None  # the long rows' [rows, heads, length, width]
        self.long_values: torch.Tensor | None = None
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # New states are [batch, heads, 1, width].
        new_keys, new_values = key_states[:, :, 0], value_states[:, :, 0]
        self._pool_keys[self._write] = new_keys
        self._pool_values[self._write] = new_values
        short = self._rows.shape[0]
        self._batch_keys[self._rows, self._lengths] = new_keys[:short]
        self._batch_values[self._rows, self._lengths] = new_values[:short]
        if self._long is not None:
            long = self._long
            long.keys[long.rows, long.lengths] = new_keys.index_select(0, long.steps)
            long.values[long.rows, long.lengths] = new_values.index_select(0, long.steps)
            self.long_keys = long.keys[:, : long.length].transpose(1, 2)
            self.long_values = long.values[:, : long.length].transpose(1, 2)
        self.keys = self._batch_keys[:, : self._length - self._start].transpose(1, 2)
        self.values = self._batch_values[:, : self._length - self._start].transpose(1, 2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._length, 0

    def get_seq_length(self) -> int:
        return self._length - 1

    def get_max_length(self) -> int:
        return -1


class StepCache(Cache):
    def __init__(self, layers: list[StepLayer]) -> None:
        super().__init__(layers=list(layers))
        self.step_layers = layers
