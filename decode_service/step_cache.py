"""The transformers Cache of one decode step over the paged pool.

The pool (``kv_pool``) is the home of every request's KV. For the step's forward the running rows'
keys and values are laid out as ``[batch, capacity, heads, width]`` (a batch context), gathered
from the pool only when the set of running rows changes or outgrows the capacity; between such
changes each step writes its new token into both the pool and the batch context, in place. A
step's attention reads the first ``length`` positions, the longest live context: its cost follows
the live context, not a fixed maximum. Shorter rows are masked by the step's attention mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from decode_service.kv_pool import KvPool

CAPACITY_STEP = 64  # the batch context grows by at least this many positions when rebuilt


class BatchContext:
    """The running rows' KV, contiguous per layer, kept across steps while the rows stay the same."""

    def __init__(self, pool: KvPool) -> None:
        self._pool = pool
        self._rows: tuple[int, ...] = ()
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.num_rebuilds = 0

    def prepare(self, rows: tuple[int, ...], blocks: Sequence[Sequence[int]], lengths: torch.Tensor) -> None:
        """Makes positions [0, lengths[i]) of every row available; gathers only when rows changed."""
        needed = int(lengths.max()) + 1
        if rows == self._rows and needed <= self.capacity:
            return
        pool = self._pool
        capacity = -(-(needed + CAPACITY_STEP) // CAPACITY_STEP) * CAPACITY_STEP
        table = torch.zeros((len(rows), pool.blocks_for(capacity)), dtype=torch.long)
        for i, row_blocks in enumerate(blocks):
            n = min(len(row_blocks), table.shape[1])
            table[i, :n] = torch.tensor(row_blocks[:n], dtype=torch.long)
        positions = torch.arange(capacity)
        slots = table[:, positions // pool.block_size] * pool.block_size + positions % pool.block_size
        flat = slots.reshape(-1).to(pool.device)
        self.keys = [k.index_select(0, flat).view(len(rows), capacity, *k.shape[1:]) for k in pool.keys]
        self.values = [v.index_select(0, flat).view(len(rows), capacity, *v.shape[1:]) for v in pool.values]
        self._rows = rows
        self.capacity = capacity
        self.num_rebuilds += 1

    def clear(self) -> None:
        self._rows = ()
        self.capacity = 0
        self.keys = []
        self.values = []


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
    ) -> None:
        super().__init__()
        self._pool_keys = pool_keys
        self._pool_values = pool_values
        self._batch_keys = batch_keys
        self._batch_values = batch_values
        self._write = write_slots  # [batch] pool slot of each row's new position
        self._rows = torch.arange(len(lengths), device=lengths.device)
        self._lengths = lengths  # [batch] each row's new position
        self._length = length
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
        self._batch_keys[self._rows, self._lengths] = new_keys
        self._batch_values[self._rows, self._lengths] = new_values
        self.keys = self._batch_keys[:, : self._length].transpose(1, 2)
        self.values = self._batch_values[:, : self._length].transpose(1, 2)
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
