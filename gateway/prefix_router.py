"""Prefix-aware choice of a prefill: the replica most likely to hold a prompt's longest cached prefix,
balanced against load.

A prefill keeps the KV of full prompt blocks (``--prefix-block-size`` tokens each) to reuse it for
later prompts sharing them. The gateway cannot see those caches; it keeps an approximate index of
what it sent where instead (as SGLang's cache-aware router and Dynamo's KV router do):

1. A prompt's full blocks are hashed as a chain: block i's hash covers block i's tokens and block
   i-1's hash, so one hash names a whole prefix.
2. Each hash maps to the replicas a prompt with that prefix was routed to. A prompt's match on a
   replica is the number of its leading blocks whose hashes list the replica.
3. The choice, among the serving replicas: the one with the longest match (the least outstanding
   calls among equals). When that replica has more than ``--prefix-balance-threshold`` calls outstanding beyond
   the least loaded one, or nothing matches, the least loaded replica is chosen instead: a popular
   prefix never piles its requests on one replica; the other replica then computes it once and
   holds it too.
4. The chosen replica is recorded under every block hash of the prompt.
5. The index is bounded: at most ``--prefix-index-blocks`` hashes, least recently used evicted first. A
   prompt's blocks are touched last to first, so a chain is evicted from its tail and its head (the
   shared prefix) stays longest.
6. A replica that leaves the pool is forgotten (``forget``); one that joins starts with no entries.
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


R = TypeVar("R", bound=Replica)


@dataclass(frozen=True)
class Routed:
    """One choice: the replica, the blocks of the prompt it was thought to hold, and why."""

    address: str
    matched_blocks: int
    outcome: str  # "prefix" (longest match), "balanced" (match overruled by load), "least-load" (no match)


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
        least = min(candidates, key=lambda c: c.outstanding)
        best_match = max(matches.values(), default=0)
        if best_match == 0:
            chosen, outcome = least, "least-load"
        else:
            holders = [c for c in candidates if matches.get(c.address, 0) == best_match]
            chosen = min(holders, key=lambda c: c.outstanding)
            outcome = "prefix"
            if chosen.outstanding - least.outstanding > self.config.prefix_balance_threshold:
                chosen, outcome = least, "balanced"
        self._record(hashes, chosen.address)
        return chosen, Routed(chosen.address, matches.get(chosen.address, 0), outcome)

    def forget(self, address: str) -> None:
        """Drops every entry of ``address`` (a replica that left)."""
        for block in [b for b, holders in self._index.items() if address in holders]:
            holders = self._index[block]
            holders.discard(address)
            if not holders:
                del self._index[block]

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
        for block in reversed(hashes):  # the head last: most recently used, evicted last
            holders = self._index.get(block)
            if holders is None:
                self._index[block] = {address}
            else:
                holders.add(address)
                self._index.move_to_end(block)
        while len(self._index) > self.config.prefix_index_blocks:
            self._index.popitem(last=False)
