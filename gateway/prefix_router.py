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
   this router predicted for them); the fewest outstanding calls among equals. A replica holding
   the prefix wins until the work queued on it costs more than computing the prefix elsewhere.
   When the choice has more than ``--prefix-balance-threshold`` calls outstanding beyond the least
   loaded replica, that one is chosen instead: a popular prefix never piles its requests on one
   replica; the other replica then computes it once and holds it too.
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

        least = min(candidates, key=lambda c: (c.outstanding, c.pending_tokens))
        chosen = min(candidates, key=lambda c: (new_tokens(c) + c.pending_tokens, c.outstanding))
        outcome = "prefix" if matches.get(chosen.address, 0) else "least-load"
        if chosen.outstanding - least.outstanding > self.config.prefix_balance_threshold:
            chosen, outcome = least, "balanced" if outcome == "prefix" else "least-load"
        self._record(hashes, chosen.address)
        return chosen, Routed(chosen.address, matches.get(chosen.address, 0), outcome, new_tokens(chosen))

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
