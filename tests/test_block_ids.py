"""Block ids of the prefill's prefix cache: never the same twice, and not a count a caller could
continue (a handle naming another prompt's blocks must not be writable from its own handles)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefill_service.block_ids import BlockIds


def test_ids_are_unique_nonzero_64_bit_integers() -> None:
    ids = BlockIds()
    seen = [ids.next_id() for _ in range(50_000)]
    assert len(set(seen)) == len(seen)
    assert all(0 < block_id < 1 << 64 for block_id in seen)


@settings(max_examples=50, deadline=None)
@given(key=st.binary(min_size=1, max_size=64), n=st.integers(min_value=0, max_value=(1 << 64) - 1))
def test_the_permutation_is_one_to_one_and_keyed(key: bytes, n: int) -> None:
    """A Feistel network: n and n + 1 (mod 2**64) never meet; the same key, the same image; another
    key (one bit flipped), other images."""
    ids = BlockIds(key)
    assert ids._permute(n) != ids._permute((n + 1) % (1 << 64))
    assert BlockIds(key)._permute(n) == ids._permute(n)
    flipped = BlockIds(bytes((key[0] ^ 1,)) + key[1:])
    span = [(n + i) % (1 << 64) for i in range(4)]
    assert [flipped._permute(i) for i in span] != [ids._permute(i) for i in span]


def test_one_id_says_nothing_of_the_next() -> None:
    """Neither the difference between consecutive ids nor their order follows a count, and two
    processes (two random keys) hand out different ids."""
    ids = BlockIds()
    seen = [ids.next_id() for _ in range(2_000)]
    steps = {b - a for a, b in itertools.pairwise(seen)}
    assert len(steps) > 1_990
    rising = sum(b > a for a, b in itertools.pairwise(seen))
    assert 800 < rising < 1_200
    other = BlockIds()
    assert not set(seen) & {other.next_id() for _ in range(2_000)}


@pytest.mark.parametrize("key", [b"", bytes(65)])
def test_a_key_of_a_wrong_size_is_refused(key: bytes) -> None:
    with pytest.raises(ValueError, match="1 to 64 bytes"):
        BlockIds(key)
