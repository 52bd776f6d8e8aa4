"""The ids a prefix cache gives its blocks: never the same twice, and not guessable from outside.

A KV handle lists the ids of the cache blocks that hold its prompt's first positions, and a decode
that holds blocks of those ids (under the same prefill instance) shares them instead of copying the
handle's KV there. Ids that count up would let a caller of the internal API (one holding the internal
token, a gateway of another tenant) write a handle naming blocks of prompts it never sent, and have
a decode run its request over their KV. So the n-th id is n run through a permutation of the 64-bit
integers keyed by a secret of the process (a Feistel network whose rounds are keyed BLAKE2b): a
permutation never repeats, and without the key one id tells nothing of any other.
"""

from __future__ import annotations

import hashlib
import os

KEY_BYTES = 16
ROUNDS = 4
HALF_BITS = 32
HALF_MASK = (1 << HALF_BITS) - 1


class BlockIds:
    """Hands out block ids: ``next_id()``, each a 64-bit integer other than 0."""

    def __init__(self, key: bytes | None = None) -> None:
        """``key``: the permutation's secret (random when None; fixed only in tests)."""
        if key is not None and not 1 <= len(key) <= 64:
            raise ValueError(f"a block id key is 1 to 64 bytes, got {len(key)}")
        self._key = key if key is not None else os.urandom(KEY_BYTES)
        self._count = 0

    def next_id(self) -> int:
        while True:
            self._count += 1
            block_id = self._permute(self._count)
            if block_id:  # 0 is no id in a proto field
                return block_id

    def _permute(self, n: int) -> int:
        left, right = n >> HALF_BITS, n & HALF_MASK
        for round_index in range(ROUNDS):
            left, right = right, left ^ self._round(round_index, right)
        return (left << HALF_BITS) | right

    def _round(self, round_index: int, half: int) -> int:
        digest = hashlib.blake2b(
            bytes((round_index,)) + half.to_bytes(4, "little"), key=self._key, digest_size=4
        ).digest()
        return int.from_bytes(digest, "little")
