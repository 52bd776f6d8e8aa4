"""The transformers Cache of one decode step over the paged pool.

Each layer's ``update`` writes the step's new key/value of every row into that row's next slot,
then returns the rows' keys and values gathered to ``[batch, heads, length, width]``, where length
is the longest live context of the step: the cost of a step follows the live context. Shorter rows
are padded at the end and masked out by the step's attention mask.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class StepLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, write_slots: torch.Tensor, gather_slots: torch.Tensor
    ) -> None:
        super().__init__()
        self._pool_keys = keys
        self._pool_values = values
        self._write = write_slots  # [batch]
        self._gather = gather_slots  # [batch, length]
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # New states are [batch, heads, 1, width]; pool tensors are [slots, heads, width].
        self._pool_keys[self._write] = key_states[:, :, 0]
        self._pool_values[self._write] = value_states[:, :, 0]
        batch, length = self._gather.shape
        flat = self._gather.reshape(-1)
        keys = self._pool_keys.index_select(0, flat)
        values = self._pool_values.index_select(0, flat)
        self.keys = keys.view(batch, length, *keys.shape[1:]).transpose(1, 2)
        self.values = values.view(batch, length, *values.shape[1:]).transpose(1, 2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self._gather.shape[1]), 0

    def get_seq_length(self) -> int:
        return int(self._gather.shape[1]) - 1

    def get_max_length(self) -> int:
        return -1


class StepCache(Cache):
    def __init__(self, layers: list[StepLayer]) -> None:
        super().__init__(layers=list(layers))
