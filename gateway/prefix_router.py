"""Prefix-aware choice of a prefill: the replica most likely to hold a prompt's longest cached prefix,
balanced against load.

A prefill keeps the KV of full prompt blocks (``--prefix-block-size`` tokens each) to reuse it for
later prompts sharing them. The gateway cannot see those caches; it keeps an approximate index of
what it sent where instead (as SGLang's cache-aware router and Dynamo's KV router do):

1. A prompt's full blocks are hashed as a chain: block i's hash covers block i's tokens and block
   i-1's hash, so one hash names a whole prefix.
2. Each hash maps to the replicas a prompt with that prefix was routed to. A prompt's match on a
   replica is the number of its leading blocks whose hashes list the replica.
3. The choice, among the serving replicas: the one with the least prompt work, counted in tokens
   (as Dynamo's KV router counts blocks): the tokens of this prompt it would compute (those past
   its match) plus those its calls in flight are expected to compute (``pending_tokens``, what
   this router predicted for them), plus the tokens of reused blocks (a later prompt was routed
   over them) that this prompt's new blocks would evict from its cache, work it would redo for the
   prompts still sharing them; the fewest outstanding calls among equals. A replica holding the
   prefix wins until the work queued on it costs more than computing the prefix elsewhere, and a
   prefix goes where it pushes out no prefix in use.
   When the choice has more than ``--prefix-balance-threshold`` calls outstanding beyond the least
   loaded replica, that one is chosen instead: a popular prefix never piles its requests on one
   replica; the other replica then computes it once and holds it too.
4. The chosen replica is recorded under every block hash of the prompt.
5. Each replica's cache is modelled as the prefill keeps it: once its capacity is known (every
   prefill answer carries it, ``learn_capacity``), the replica holds at most that many blocks, its
   least recently routed ones leaving first, so a prefix the replica has evicted no longer counts
   as held there.
6. The index is bounded: at most ``--prefix-index-blocks`` hashes, least recently used evicted first. A
   prompt's blocks are touched last to first, so a chain is evicted from its tail and its head (the
   shared prefix) stays longest.
7. A replica that leaves the pool is forgotten (``forget``); one that joins starts with no entries.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pdserve.config.prefill_routing import PrefillRouting


class Replica(Protocol):
    """What the router reads of a backend."""

    @property
    def address(self) -> str: ...

    @property
    def outstanding(self) -> int: ...

    @property
    def pending_tokens(self) -> int: ...


R = TypeVar("R", bound=Replica)


@dataclass(frozen=True)
class Routed:
    """One choice: the replica, the blocks of the prompt it was thought to hold, the prompt tokens it
    is expected to compute, and why."""

    address: str
    matched_blocks: int
    outcome: str  # "prefix" (over a match), "balanced" (overruled by load), "least-load" (no match used)
    new_tokens: int = 0


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` (a partial last block has none)."""
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, *token_ids[start : start + block_size]))
        hashes.append(previous)
    return hashes


class PrefixRouter:
    def __init__(self, config: PrefillRouting) -> None:
        self.config = config
        # block hash -> addresses it was routed to, least recently used first
        self._index: collections.OrderedDict[int, set[str]] = collections.OrderedDict()
        # address -> the blocks its cache is thought to hold, least recently routed first, each
        # with whether a later prompt was routed there over it (reused)
        self._held: dict[str, collections.OrderedDict[int, bool]] = {}
        self._capacity: dict[str, int] = {}  # address -> its cache's blocks (absent: not known yet)

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def matched_blocks(self, token_ids: Sequence[int], address: str) -> int:
        """Leading full blocks of ``token_ids`` the index says ``address`` holds."""
        count = 0
        for block in block_hashes(token_ids, self.config.prefix_block_size):
            holders = self._index.get(block)
            if holders is None or address not in holders:
                break
            count += 1
        return count

    def choose(self, token_ids: Sequence[int], candidates: Sequence[R]) -> tuple[R, Routed]:
        """The replica of ``candidates`` (non-empty) for ``token_ids``, recorded under its blocks."""
        if not candidates:
            raise ValueError("no replica to choose from")
        hashes = block_hashes(token_ids, self.config.prefix_block_size)
        matches = self._matches(hashes, candidates)

        def new_tokens(c: Replica) -> int:
            return len(token_ids) - matches.get(c.address, 0) * self.config.prefix_block_size

        prompt = set(hashes)

        def cost(c: Replica) -> int:
            return new_tokens(c) + c.pending_tokens + self._reused_tokens_evicted(prompt, c.address)

        least = min(candidates, key=lambda c: (c.outstanding, c.pending_tokens))
        chosen = min(candidates, key=lambda c: (cost(c), c.outstanding))
        outcome = "prefix" if matches.get(chosen.address, 0) else "least-load"
        if chosen.outstanding - least.outstanding > self.config.prefix_balance_threshold:
            chosen, outcome = least, "balanced" if outcome == "prefix" else "least-load"
        self._record(hashes, chosen.address)
        return chosen, Routed(chosen.address, matches.get(chosen.address, 0), outcome, new_tokens(chosen))

    def learn_capacity(self, address: str, cache_tokens: int) -> None:
        """``address``'s prefix cache holds ``cache_tokens`` tokens (0: it has none)."""
        self._capacity[address] = cache_tokens // self.config.prefix_block_size
        self._trim(address)

    def forget(self, address: str) -> None:
        """Drops every entry of ``address`` (a replica that left)."""
        for block in self._held.pop(address, {}):
            self._drop(block, address)
        self._capacity.pop(address, None)

    def _matches(self, hashes: Sequence[int], candidates: Sequence[Replica]) -> dict[str, int]:
        alive = {c.address for c in candidates}
        matches: dict[str, int] = {}
        for depth, block in enumerate(hashes, start=1):
            holders = self._index.get(block)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for address in alive:
                matches[address] = depth
        return matches

    def _record(self, hashes: Sequence[int], address: str) -> None:
        held = self._held.setdefault(address, collections.OrderedDict())
        for block in reversed(hashes):  # the head last: most recently used, evicted last
            holders = self._index.get(block)
            if holders is None:
                self._index[block] = {address}
            else:
                holders.add(address)
                self._index.move_to_end(block)
            held[block] = block in held  # reused: routed here again while held
            held.move_to_end(block)
        self._trim(address)
        while len(self._index) > self.config.prefix_index_blocks:
            block, holders = self._index.popitem(last=False)
            for holder in holders:
                self._held[holder].pop(block, None)

    def _reused_tokens_evicted(self, prompt: set[int], address: str) -> int:
        """Tokens of reused blocks that the blocks of ``prompt`` (its block hashes) new to ``address``
        would push out of its cache (its least recently routed blocks first): the work it would later
        redo for prompts still sharing them."""
        capacity = self._capacity.get(address)
        held = self._held.get(address)
        if capacity is None or held is None:
            return 0
        # Counted over the prompt's blocks: ``prompt - held.keys()`` would walk every held block.
        excess = len(held) + sum(1 for block in prompt if block not in held) - capacity
        evicted = lost = 0
        for block, reused in held.items():
            if evicted >= excess:
                break
            if block not in prompt:
                evicted += 1
                lost += reused
        return lost * self.config.prefix_block_size

    def _trim(self, address: str) -> None:
        """Evicts ``address``'s least recently routed blocks beyond its cache's capacity."""
        capacity = self._capacity.get(address)
        held = self._held.get(address)
        if capacity is None or held is None:
            return
        while len(held) > capacity:
            block, _ = held.popitem(last=False)
            self._drop(block, address)

    def _drop(self, block: int, address: str) -> None:
        holders = self._index.get(block)
        if holders is not None:
            holders.discard(address)
            if not holders:
                del self._index[block]
