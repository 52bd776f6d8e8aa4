"""Paged KV storage of a decode process.

Per layer there is one key tensor ``[num_blocks * block_size, heads, width]`` (token-major, so a
gathered position is one contiguous row) and one value tensor of the same form (key and value
widths may differ, as in MLA models). A request owns a list of blocks; the position ``p`` of a
request lives at token slot ``blocks[p // block_size] * block_size + p % block_size`` (``slot``,
``slots``). A request reserves, when admitted, every block it can need until it finishes, so a
running request never runs out of space: requests that do not fit wait.

Blocks of a prompt prefix are shared. A KV handle names the prefix-cache blocks its first positions
came from (``KvHandle.block_ids``: a prefill instance's block ids, equal ids holding equal KV bit for
bit); a request's full prompt blocks are kept under those keys. A request joining with keys whose
leading blocks the pool holds takes those blocks as they are (a reference each) and copies only the
rest of its KV (``admit``, ``write``). A keyed block nobody holds stays, least recently used first,
until a block is needed and no block is free (``num_free_blocks`` counts it free). Only full prompt
blocks are keyed: a step writes its new positions past them, never into a shared block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kv.host_pages import zeroed_pool
from pdserve.kv.layout import KvLayout
from pdserve.model.compiled_forward import static_dims

# A block's KV as a prefill's prefix cache named it: (prefill instance id, block id there).
BlockKey = tuple[str, int]


@dataclass(frozen=True)
class PrefixBlocks:
    """The prefix-cache blocks a KV handle names for its first positions (``KvHandle.block_ids``)."""

    instance_id: str = ""
    block_size: int = 0
    block_ids: tuple[int, ...] = ()

    def keys(self, block_size: int) -> tuple[BlockKey, ...]:
        """The pool keys of the blocks, for a pool of ``block_size`` tokens per block (none when the
        prefill's blocks are of another size)."""
        if block_size != self.block_size:
            return ()
        return tuple((self.instance_id, block_id) for block_id in self.block_ids)


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
            static_dims(zeroed_pool((num_slots, h, w), layout.dtype, device), 1, 2) for h, w in layout.keys
        ]
        self.values = [
            static_dims(zeroed_pool((num_slots, h, w), layout.dtype, device), 1, 2) for h, w in layout.values
        ]
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # keyed, held by nobody: LRU first
        self.num_shared_tokens = 0  # positions requests took from blocks held already (not copied)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request may take: free ones, and keyed ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_idle_blocks(self) -> int:
        """Keyed blocks nobody holds, kept for requests that share them."""
        return len(self._idle)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def key_of(self, block: int) -> BlockKey | None:
        """The key of a block's KV, None when it has none."""
        return self._key_of.get(block)

    def held(self, keys: Sequence[BlockKey]) -> list[int]:
        """The blocks holding the leading ``keys``, up to the first the pool does not hold."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_allocate(self, num_tokens: int, keys: Sequence[BlockKey] = ()) -> bool:
        """Whether ``admit(num_tokens, keys)`` finds room."""
        return self._fits(num_tokens, self.held(keys))

    def _fits(self, num_tokens: int, held: Sequence[int]) -> bool:
        """Whether the blocks besides ``held`` (which a request shares) can be taken: free ones, and
        idle ones other than those ``held`` takes back."""
        idle_held = sum(1 for block in held if self._refs[block] == 0)
        return self.blocks_for(num_tokens) - len(held) <= self.num_free_blocks - idle_held

    def allocate(self, num_tokens: int) -> list[int]:
        """Blocks of their own for ``num_tokens`` positions."""
        return self.admit(num_tokens)[0]

    def admit(self, num_tokens: int, keys: Sequence[BlockKey] = ()) -> tuple[list[int], int]:
        """Blocks for ``num_tokens`` positions of a request whose full prompt blocks have ``keys``:
        the leading ones the pool holds already, shared, then blocks of its own (the keyed ones kept
        under their keys). Returns them and the positions the shared ones cover (KV not to write)."""
        held = self.held(keys)
        needed = self.blocks_for(num_tokens) - len(held)
        if not self._fits(num_tokens, held):
            raise MemoryError(f"KV pool has {self.num_free_blocks} free blocks, {needed} needed")
        for block in held:
            if self._refs[block] == 0:
                del self._idle[block]
            self._refs[block] += 1
        own = [self._take() for _ in range(needed)]
        for key, block in zip(keys[len(held) :], own, strict=False):
            if key not in self._block_of:
                self._key_of[block], self._block_of[key] = key, block
        shared = min(len(held) * self.block_size, num_tokens)
        self.num_shared_tokens += shared
        return held + own, shared

    def free(self, blocks: Sequence[int]) -> None:
        """Gives a request's references back: an unkeyed block is free again, a keyed one idle
        (the request's later blocks before its earlier ones in eviction order)."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)

    def _take(self) -> int:
        """A block nobody holds: a free one, else the least recently used idle one (its key dropped)."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._idle.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
        self._refs[block] = 1
        return block

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

    def write(
        self, blocks: Sequence[int], kv: Sequence[tuple[torch.Tensor, torch.Tensor]], start: int = 0
    ) -> int:
        """Copies a request's received KV (per layer ``[heads, T, width]``) from position ``start`` on
        to positions [start, T) (the ones before are in shared blocks); returns T."""
        num_tokens = int(kv[0][0].shape[1])
        if start >= num_tokens:
            return num_tokens
        index = self.slots(blocks, start, num_tokens - start)
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][index] = k[:, start:].transpose(0, 1).to(self.device, self.layout.dtype)
            self.values[layer][index] = v[:, start:].transpose(0, 1).to(self.device, self.layout.dtype)
        return num_tokens
