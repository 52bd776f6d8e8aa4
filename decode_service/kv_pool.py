"""Paged KV storage of a decode process.

Per layer there is one key tensor ``[num_blocks * block_size, heads, width]`` (token-major, so a
gathered position is one contiguous row) and one value tensor of the same form (key and value
widths may differ, as in MLA models). A request owns a list of blocks; the position ``p`` of a
request lives at token slot ``blocks[p // block_size] * block_size + p % block_size`` (``slot``,
``slots``). Admitting a request copies only its own KV into its blocks; nothing else
moves. A request reserves, when admitted, every block it can need until it finishes, so a
running request never runs out of space: requests that do not fit wait.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.kv.layout import KvLayout
from pdserve.model.compiled_forward import static_dims


class KvPool:
    def __init__(self, layout: KvLayout, num_blocks: int, block_size: int, device: torch.device) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the KV pool needs blocks, got {num_blocks} blocks of {block_size}")
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        num_slots = num_blocks * block_size
        # Heads and width are the model's: constants of a compiled step (see ``static_dims``).
        self.keys = [
            static_dims(torch.zeros(num_slots, h, w, dtype=layout.dtype, device=device), 1, 2)
            for h, w in layout.keys
        ]
        self.values = [
            static_dims(torch.zeros(num_slots, h, w, dtype=layout.dtype, device=device), 1, 2)
            for h, w in layout.values
        ]
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, num_tokens: int) -> list[int]:
        needed = self.blocks_for(num_tokens)
        if needed > len(self._free):
            raise MemoryError(f"KV pool has {len(self._free)} free blocks, {needed} needed")
        return [self._free.pop() for _ in range(needed)]

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(reversed(blocks))

    def slot(self, blocks: Sequence[int], position: int) -> int:
        """The token slot of position ``position`` of a request owning ``blocks``."""
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def slots(self, blocks: Sequence[int], start: int, count: int) -> torch.Tensor:
        """Token slots of positions [start, start + count) of a request owning ``blocks``."""
        positions = torch.arange(start, start + count)
        table = torch.tensor(blocks, dtype=torch.long)
        return (table[positions // self.block_size] * self.block_size + positions % self.block_size).to(
            self.device
        )

    def write(self, blocks: Sequence[int], kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Copies a request's received KV (per layer ``[heads, T, width]``) to positions [0, T)."""
        num_tokens = kv[0][0].shape[1]
        index = self.slots(blocks, 0, num_tokens)
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][index] = k.transpose(0, 1).to(self.device, self.layout.dtype)
            self.values[layer][index] = v.transpose(0, 1).to(self.device, self.layout.dtype)
        return int(num_tokens)
