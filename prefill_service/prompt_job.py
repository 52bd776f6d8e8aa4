"""A prompt as the prefill engine runs it: its tokens, the KV it has so far and its prefix-cache blocks.

A job begins when the engine first schedules it: it takes the longest cached prefix of its prompt
(``PrefixCache.lookup``; the blocks stay referenced until its first forward has used them) and starts
with that KV. Each forward then runs its next chunk over the KV it has, until the whole prompt has
run; the logits of that last forward give its first token. After every forward the engine offers
the cache the job's full blocks it does not know yet.

``block_ids`` are the ids of the cache blocks that hold, bit for bit, the job's first blocks' KV:
those it took from the cache, then those the cache took from it; the run ends at the first block
that the cache holds with other KV (computed by another prompt meanwhile, or cut from its match) or
had no room for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.sampling import SamplingParams
from prefill_service.prefix_cache import LayerKv, PrefixCache, PrefixMatch


@dataclass(eq=False)
class PromptJob:
    token_ids: Sequence[int]
    params: SamplingParams
    num_generated: int  # the prompt's last tokens the request generated before (a resumed one)
    request: Any  # whom the engine answers when the job ends (None: a warm-up prompt)
    hashes: list[bytes] = field(default_factory=list)  # of the prompt's full blocks (with a cache)
    match: PrefixMatch | None = None  # cached blocks held until the first forward used them
    begun: bool = False
    started: float = 0.0  # time.perf_counter() of the beginning
    cached_tokens: int = 0  # taken from the prefix cache
    done: int = 0  # tokens whose KV the job has (cached or run)
    kv: LayerKv | None = None  # that KV, per layer [heads, done, width]
    num_blocks_cached: int = 0  # of its full blocks, how many are known to the cache
    block_ids: list[int] = field(default_factory=list)  # cache blocks holding its first blocks' KV
    block_ids_open: bool = True  # whether the next block's id may still extend ``block_ids``
    forward_seconds: float = 0.0  # of the forwards it ran in
    prompt_logits: list[Any] = field(default_factory=list)  # each chunk's logits, for prompt_logprobs

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether the request asks for its prompt's logprobs (every position's logits are kept, and
        nothing is taken from the prefix cache, whose blocks have no logits)."""
        return self.params.prompt_logprobs is not None

    @property
    def remaining(self) -> int:
        return len(self.token_ids) - self.done

    def begin(self, cache: PrefixCache | None, now: float) -> None:
        """Takes the longest cached prefix of the prompt (none without a cache)."""
        self.begun, self.started = True, now
        if cache is None or self.wants_prompt_logits:
            return
        self.hashes = cache.hashes(self.token_ids)
        self.match = cache.lookup(self.hashes, len(self.token_ids))
        self.num_blocks_cached = len(self.match.blocks)
        if self.match.blocks:
            self.cached_tokens = self.done = self.match.num_tokens
            self.kv = cache.kv(self.match)
            self.block_ids = [block.uid for block in self.match.blocks]

    def next_chunk(self, num_tokens: int) -> Sequence[int]:
        return self.token_ids[self.done : self.done + num_tokens]

    def ran(self, num_tokens: int, cache: PrefixCache | None) -> list[tuple[bytes, int]]:
        """After a forward ran ``num_tokens`` more of the prompt: releases the cached blocks it
        used, and returns the full blocks now complete that the cache does not know yet (hash,
        index in the prompt), for the engine to offer it."""
        self.done += num_tokens
        if cache is None:
            return []
        self.release(cache)
        full = min(self.done // cache.block_size, len(self.hashes))
        new = [(self.hashes[b], b) for b in range(self.num_blocks_cached, full)]
        self.num_blocks_cached = max(full, self.num_blocks_cached)
        return new

    def cached(self, first: int, ids: Sequence[int | None]) -> None:
        """The cache took the job's blocks ``first``, ``first + 1``... as ``ids`` (None: not taken)."""
        if first != len(self.block_ids):
            self.block_ids_open = False
        for block_id in ids:
            if not self.block_ids_open or block_id is None:
                self.block_ids_open = False
                return
            self.block_ids.append(block_id)

    def release(self, cache: PrefixCache | None) -> None:
        """Gives the cached blocks back (idempotent)."""
        if self.match is not None and cache is not None:
            cache.release(self.match)
        self.match = None
