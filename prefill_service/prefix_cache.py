"""The prefill's prefix cache: the KV of full prompt blocks already computed, found again by hash.

A prompt is cut into blocks of ``block_size`` tokens; block i's hash is chained (vLLM's scheme): it
covers the hash of block i - 1 and block i's own tokens, so it names the whole prefix up to the end
of that block, and two prompts share a block's KV exactly when they share every token up to it. Only
full blocks are cached; a prompt's last token is never taken from the cache (its forward must give
the logits of the first token), so at most ``(len(prompt) - 1) // block_size`` blocks of a prompt
are found.

Each block's keys and values lie in one slot of per-layer pools ``[heads, blocks * block_size,
width]`` allocated once on the model's device and written (zeros) right away, as the decode's pool
is: a page of host memory written for the first time faults, and a cache filled slot after slot by
new prompts would otherwise pay that on every prompt's copy until it is full (the reference model
of ``shared/PEERS.md``, 1024-token prompts one after another on one thread of the 2-core CPU
machine: 159-160 ms each against 138-139 ms on pools written before; writing its 1.5 GiB at start
takes 0.5-3.5 s). A prompt's blocks, in consecutive slots as a rule,
are copied in as one slice and read back as a view (a match stops before a few last blocks in
other slots; one scattered further is gathered with one index per layer and tensor, once for all
the matches of the same blocks held at a time). ``lookup`` takes a reference on the blocks it finds
(``release`` gives it back); a block nobody references waits in LRU order (a prompt's later blocks
before its earlier ones) and is evicted when ``insert`` needs room. The cache never holds more than
``capacity_tokens`` tokens: when every block is referenced, a new block is simply not cached.

Where ``insert`` puts new blocks keeps a prompt's blocks in consecutive slots once the cache is
full too: evicting slot by slot in LRU order would scatter every prompt cached from then on over
the slots its predecessors left, and each later hit on it would gather its KV (measured on the
reference model of ``shared/PEERS.md``, 1024 cached tokens: 3-60 ms per request on the 2-core CPU
machine, where a view costs nothing). The blocks of one insert take the run of as many consecutive
slots, each unused or holding an unreferenced block, whose most recently used block is the least
recently used (unused slots first): the blocks it evicts are all older than that one. A prompt's
blocks offered after an earlier forward of the same prompt (a chunked prompt) take the slots right
after its previous block when those can be taken. Only when no such run exists (referenced blocks
everywhere between) do the blocks go slot by slot in LRU order.

Every block cached gets an id of its own (``Block.uid``, from ``BlockIds``: never given twice by one
cache, and not guessable): a prompt's KV handle lists the ids of its first blocks, so that a decode
holding blocks of the same ids already knows their KV, bit for bit, without copying or comparing it.
A block evicted and computed again is a new block with a new id (its KV may differ in rounding from
the first one's).

The cache belongs to the engine thread: it is not locked (its gauges read plain integers).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from pdserve.kv.host_memory import host_memory_bytes
from pdserve.kv.host_pages import zeroed_pool
from pdserve.kv.layout import KvLayout
from prefill_service.block_ids import BlockIds

MAX_BLOCK_SIZE = 4096
# A match whose first blocks lie in consecutive slots, this share of them at least (3/4), stops where
# they stop: its KV is then a view of the pools, not a copy gathered for every request (a prompt seen
# before matches its own later blocks too, cached apart from the prefix it shares).
MIN_RUN_SHARE = (3, 4)
HASH_BYTES = 16
UNUSED = -1  # the age of a slot never used, or emptied by ``clear``
HELD = np.iinfo(np.int64).max  # the age of a slot whose block is referenced (or being filled)
MAX_DEFAULT_BYTES = 4 << 30

# Per layer, the keys and values of some tokens: ``[heads, tokens, width]`` each.
LayerKv = list[tuple[torch.Tensor, torch.Tensor]]


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of every full block of ``token_ids``."""
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        h.update(array("q", token_ids[start : start + block_size]).tobytes())
        parent = h.digest()
        hashes.append(parent)
    return hashes


def default_capacity_tokens(bytes_per_token: int, device: torch.device) -> int:
    """The default bound: 1/16 of the device's memory, at most ``MAX_DEFAULT_BYTES``, in tokens; on
    a CPU the memory this process may use (``host_memory``: a container's limit where smaller), as
    the pools are written whole at start."""
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = host_memory_bytes()
    return min(memory // 16, MAX_DEFAULT_BYTES) // max(bytes_per_token, 1)


def reuse_problem(model: object) -> str | None:
    """Why the prefix cache cannot reuse this model's KV exactly, or None when it can: every layer
    of its cache must hold all positions, in order (no sliding window, no chunked attention)."""
    config = getattr(model, "config", None)
    try:
        cache = DynamicCache(config=config)
    except Exception as exc:  # a config transformers cannot build a cache of
        return f"its cache cannot be built ({exc})"
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False) or type(layer).__name__ != "DynamicLayer":
            return f"layer {i} caches a window ({type(layer).__name__}), not every position"
    return None


@dataclass(eq=False)
class Block:
    block_hash: bytes
    slot: int  # where its KV lies in the cache's pools
    uid: int = 0  # unique within the cache
    refs: int = 0


@dataclass
class PrefixMatch:
    """Blocks ``lookup`` found for a prompt, referenced until ``PrefixCache.release``."""

    blocks: list[Block] = field(default_factory=list)
    block_size: int = 0
    gathered: tuple[int, ...] | None = None  # the slots of the gathered KV it holds (``kv``)

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


class PrefixCache:
    def __init__(
        self,
        block_size: int,
        capacity_tokens: int,
        layout: KvLayout,
        device: torch.device,
        on_evict: Callable[[int], None] | None = None,
        block_ids: BlockIds | None = None,
    ) -> None:
        """Holds at most ``capacity_tokens`` (rounded down to whole blocks) of KV of ``layout`` on
        ``device``, in pools allocated once. ``on_evict``: told the number of tokens of each eviction;
        ``block_ids``: where the blocks' ids come from (a new ``BlockIds`` by default)."""
        if not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [1, {MAX_BLOCK_SIZE}], got {block_size}")
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        n = self.capacity_blocks
        self._pools = [
            (
                zeroed_pool((kh, n * block_size, kw), layout.dtype, device),
                zeroed_pool((vh, n * block_size, vw), layout.dtype, device),
            )
            for (kh, kw), (vh, vw) in zip(layout.keys, layout.values, strict=True)
        ]
        self._device = device
        self._blocks: dict[bytes, Block] = {}
        self._free: OrderedDict[bytes, Block] = OrderedDict()  # unreferenced, least recently used first
        self._slot_blocks: list[Block | None] = [None] * n  # the block in each slot (None: unused)
        # Per slot, when insert may take it: UNUSED, when its block was freed (the order of
        # ``_free``), or HELD (its block is referenced) .
        self._age = np.full(n, UNUSED, dtype=np.int64)
        self._clock = 0
        self._next_unused = 0  # unused slots from here on, at the start (consecutive, lowest first)
        # Gathered KV of scattered matches, shared by the matches of the same slots: (holders, kv).
        self._gathered: dict[tuple[int, ...], tuple[int, LayerKv]] = {}
        self._on_evict = on_evict
        self._ids = block_ids if block_ids is not None else BlockIds()
        # Copies ``insert`` planned and ``flush`` makes: the blocks, their runs of (first block of
        # kv, first slot, blocks) and the kv.
        self._pending: list[tuple[list[Block], list[tuple[int, int, int]], LayerKv]] = []

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    @property
    def num_tokens(self) -> int:
        """Tokens cached now."""
        return len(self._blocks) * self.block_size

    @property
    def num_referenced_blocks(self) -> int:
        return len(self._blocks) - len(self._free)

    @property
    def num_gathered(self) -> int:
        """Copies of scattered matches' KV held now (one per set of blocks, while a match holds it)."""
        return len(self._gathered)

    def hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        return block_hashes(token_ids, self.block_size)

    def lookup(self, hashes: Sequence[bytes], num_prompt_tokens: int) -> PrefixMatch:
        """The cached blocks that start a prompt of these block hashes, each referenced once; never
        the block of the prompt's last token."""
        self.flush()
        usable = min(len(hashes), (num_prompt_tokens - 1) // self.block_size)
        found: list[Block] = []
        for block_hash in hashes[:usable]:
            block = self._blocks.get(block_hash)
            if block is None:
                break
            found.append(block)
        run = next((i for i in range(1, len(found)) if found[i].slot != found[0].slot + i), len(found))
        if run * MIN_RUN_SHARE[1] >= len(found) * MIN_RUN_SHARE[0]:
            found = found[:run]  # the few blocks after are computed again rather than gathered
        match = PrefixMatch(block_size=self.block_size)
        for block in found:
            if block.refs == 0:
                del self._free[block.block_hash]
                self._age[block.slot] = HELD
            block.refs += 1
            match.blocks.append(block)
        return match

    def kv(self, match: PrefixMatch) -> LayerKv:
        """Per layer, the keys and values of a match's tokens ``[heads, tokens, width]``: views of the
        pools when its blocks lie in consecutive slots (as a prompt's blocks do, as a rule), valid
        while the match holds its references; new tensors otherwise."""
        self.flush()
        size = self.block_size
        first = match.blocks[0].slot if match.blocks else 0
        if all(block.slot == first + i for i, block in enumerate(match.blocks)):
            start, end = first * size, (first + len(match.blocks)) * size
            return [(keys[:, start:end], values[:, start:end]) for keys, values in self._pools]
        slots = tuple(block.slot for block in match.blocks)
        if match.gathered is not None:
            return self._gathered[match.gathered][1]
        holders, kv = self._gathered.get(slots, (0, []))
        if not holders:
            tokens = torch.tensor(
                [slot * size + t for slot in slots for t in range(size)], device=self._device
            )
            kv = [
                (keys.index_select(1, tokens), values.index_select(1, tokens)) for keys, values in self._pools
            ]
        self._gathered[slots] = (holders + 1, kv)
        match.gathered = slots
        return kv

    def release(self, match: PrefixMatch) -> None:
        """Gives back ``lookup``'s references (once); blocks nobody references become evictable, a
        prompt's last blocks first."""
        for block in reversed(match.blocks):
            block.refs -= 1
            if block.refs == 0 and self._blocks.get(block.block_hash) is block:
                self._make_free(block)
        match.blocks = []
        if match.gathered is not None:
            holders, kv = self._gathered.pop(match.gathered)
            if holders > 1:
                self._gathered[match.gathered] = (holders - 1, kv)
            match.gathered = None

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def insert(self, hashes: Sequence[bytes], kv: LayerKv, after: bytes | None = None) -> list[int | None]:
        """Caches a copy of consecutive blocks of a prompt: ``kv`` holds their tokens (per layer
        ``[heads, len(hashes) * block_size, width]``), ``hashes`` their hashes; ``after``: the hash
        of the prompt's block before them, when the same prompt's earlier forward computed it. Evicts
        unreferenced blocks when full, least recently used first (see the module's text). Returns, per
        hash, the id of the block cached with ``kv``'s tokens, or None where none was (one already
        there, or no room left because every block is referenced). The copy itself waits for the
        next ``flush``: the engine answers a forward's prompts first."""
        added: list[Block] = []
        uids: list[int | None] = [None] * len(hashes)
        runs: list[tuple[int, int, int]] = []  # (first block of kv, first slot, blocks): consecutive slots
        new = [i for i, block_hash in enumerate(hashes) if block_hash not in self._blocks]
        previous = self._blocks.get(after) if after is not None else None
        slots = self._take_slots(len(new), previous.slot + 1 if previous is not None else None)
        for i, slot in zip(new, slots, strict=False):  # fewer slots: no room for the later blocks
            block_hash = hashes[i]
            block = Block(block_hash, slot, self._ids.next_id())
            self._slot_blocks[slot] = block
            self._blocks[block_hash] = block
            added.append(block)
            uids[i] = block.uid
            if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == slot:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((i, slot, 1))
        if runs:
            self._pending.append((added, runs, kv))
        for block in reversed(added):  # the prompt's later blocks are evicted first
            self._make_free(block)
        return uids

    def flush(self) -> None:
        """Copies the KV of the blocks inserted since the last flush into their slots, in the order
        they were inserted (a slot taken twice ends with its last block's KV). Until then ``insert``'s
        ``kv`` must stay as it was; ``lookup`` and ``kv`` flush first. A copy that fails leaves its
        blocks and the ones after it out of the cache, then raises."""
        pending, self._pending = self._pending, []
        size = self.block_size
        for done, (_, runs, kv) in enumerate(pending):
            try:
                for (keys, values), (k, v) in zip(self._pools, kv, strict=True):
                    for first, slot, count in runs:
                        keys[:, slot * size : (slot + count) * size].copy_(
                            k[:, first * size : (first + count) * size]
                        )
                        values[:, slot * size : (slot + count) * size].copy_(
                            v[:, first * size : (first + count) * size]
                        )
            except BaseException:
                for blocks, _, _ in pending[done:]:
                    for block in blocks:
                        self._drop(block)
                raise

    def _make_free(self, block: Block) -> None:
        """``block`` is referenced no more: it may be evicted, after the blocks freed before it."""
        self._free[block.block_hash] = block
        self._age[block.slot] = self._clock
        self._clock += 1

    def _take_slots(self, count: int, wanted: int | None) -> list[int]:
        """``count`` slots emptied for new blocks (fewer when the rest is referenced): ``wanted`` and
        the slots following it when they can be taken, else the run of consecutive slots whose most
        recently freed block is the least recently freed, else slot by slot in LRU order."""
        if count == 0:
            return []
        n = len(self._slot_blocks)
        start: int | None = None
        if (
            wanted is not None
            and wanted + count <= n
            and bool((self._age[wanted : wanted + count] != HELD).all())
        ):
            start = wanted
        elif self._next_unused + count <= n:  # never used yet: the next ones in order
            start = self._next_unused
        if start is None:
            start = self._oldest_run(count)
        slots = self._least_recent(count) if start is None else list(range(start, start + count))
        for slot in slots:
            self._evict(slot)
        return slots

    def _oldest_run(self, count: int) -> int | None:
        """The first slot of the run of ``count`` takeable slots whose newest block is the oldest."""
        if count > len(self._slot_blocks):
            return None
        newest = self._age if count == 1 else _window_max(self._age, count)
        first = int(np.argmin(newest))
        return first if newest[first] != HELD else None

    def _least_recent(self, count: int) -> list[int]:
        """Up to ``count`` takeable slots, unused ones first, then in the order their blocks were freed."""
        takeable = np.flatnonzero(self._age != HELD)
        order = np.argsort(self._age[takeable], kind="stable")
        return [int(slot) for slot in takeable[order[:count]]]

    def _evict(self, slot: int) -> None:
        """Empties a takeable slot."""
        block = self._slot_blocks[slot]
        self._age[slot] = HELD  # the caller fills it
        self._next_unused = max(self._next_unused, slot + 1)
        if block is None:
            return
        self._slot_blocks[slot] = None
        del self._free[block.block_hash]
        del self._blocks[block.block_hash]
        if self._on_evict is not None:
            self._on_evict(self.block_size)

    def clear(self) -> None:
        """Drops every unreferenced block."""
        self.flush()
        for block in list(self._free.values()):
            self._drop(block)

    def _drop(self, block: Block) -> None:
        """Takes an unreferenced block out of the cache (none when evicted already)."""
        if block.refs or self._blocks.get(block.block_hash) is not block:
            return
        del self._blocks[block.block_hash]
        del self._free[block.block_hash]
        self._slot_blocks[block.slot] = None
        self._age[block.slot] = UNUSED


def _window_max(values: np.ndarray, width: int) -> np.ndarray:
    """The maximum of every window of ``width`` consecutive ``values`` (van Herk / Gil-Werman: two
    running maxima per block of ``width``, linear in the length)."""
    n = len(values)
    padded = np.concatenate([values, np.full(-n % width, values.max(initial=0), dtype=values.dtype)])
    blocks = padded.reshape(-1, width)
    ahead = np.maximum.accumulate(blocks, axis=1).ravel()  # max from the block's start
    behind = np.maximum.accumulate(blocks[:, ::-1], axis=1)[:, ::-1].ravel()  # max to the block's end
    first = np.arange(n - width + 1)
    return np.maximum(behind[first], ahead[first + width - 1])
