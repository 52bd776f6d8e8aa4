"""The running rows' KV in two batch contexts: a few rows much longer than the rest live in the
long tier, every row is held once with its KV, and rows move between tiers only when the running
set changes."""

from __future__ import annotations

import torch

from decode_service.batch_tiers import BatchTiers
from decode_service.kv_pool import KvPool
from tests.test_step_cache import LAYOUT, Requests


def make(split: bool = True) -> tuple[BatchTiers, Requests]:
    pool = KvPool(LAYOUT, num_blocks=1024, block_size=4, device=torch.device("cpu"))
    return BatchTiers(pool, max_rows=64, split=split), Requests(pool)


def sync(tiers: BatchTiers, requests: Requests) -> list[int]:
    serials = list(requests.blocks)
    order = tiers.sync(serials, [requests.blocks[s] for s in serials], [requests.lengths[s] for s in serials])
    return [serials[i] for i in order]


def assert_tiers_hold_pool(tiers: BatchTiers, requests: Requests, rows: list[int]) -> None:
    """Each row's KV, in the tier and row the step order gives it, equals its blocks in the pool."""
    pool = requests.pool
    assert tiers.short.serials + tiers.long.serials == rows
    assert sorted(rows) == sorted(requests.blocks)
    for context in (tiers.short, tiers.long):
        for row, serial in enumerate(context.serials):
            n = requests.lengths[serial]
            slots = pool.slots(requests.blocks[serial], 0, n)
            for layer in range(LAYOUT.num_layers):
                assert torch.equal(context.keys[layer][row, :n], pool.keys[layer][slots])
                assert torch.equal(context.values[layer][row, :n], pool.values[layer][slots])


def test_a_long_row_among_short_ones_lives_in_the_long_tier() -> None:
    tiers, requests = make()
    for serial in range(8):
        requests.add(serial, 4 + serial)
    requests.add(8, 400)
    rows = sync(tiers, requests)
    assert rows[-1] == 8 and tiers.num_long == 1 and tiers.num_short == 8
    assert_tiers_hold_pool(tiers, requests, rows)
    assert tiers.short.capacity < 400 <= tiers.long.capacity  # the short rows are not padded to it


def test_without_split_every_row_is_short() -> None:
    tiers, requests = make(split=False)
    for serial in range(8):
        requests.add(serial, 4 + serial)
    requests.add(8, 400)
    rows = sync(tiers, requests)
    assert tiers.num_long == 0 and tiers.short.capacity > 400
    assert_tiers_hold_pool(tiers, requests, rows)


def test_the_split_is_decided_again_only_when_the_running_set_changes() -> None:
    tiers, requests = make()
    for serial in range(8):
        requests.add(serial, 4 + serial)
    requests.add(8, 400)
    sync(tiers, requests)
    copied = tiers.short.num_rows_copied + tiers.long.num_rows_copied
    for _ in range(3):  # steps of the same rows: nothing moves
        rows = sync(tiers, requests)
    assert tiers.short.num_rows_copied + tiers.long.num_rows_copied == copied
    assert rows[-1] == 8
    # Long rows join until they are no minority: the split goes, the long row moves back.
    for serial in range(9, 17):
        requests.add(serial, 390 + serial)
    rows = sync(tiers, requests)
    assert tiers.num_long == 0 and tiers.num_short == 17
    assert_tiers_hold_pool(tiers, requests, rows)
    # They leave again: the first long row is taken apart once more.
    for serial in range(9, 17):
        requests.remove(serial)
    rows = sync(tiers, requests)
    assert rows[-1] == 8 and tiers.num_long == 1
    assert_tiers_hold_pool(tiers, requests, rows)


def test_when_the_long_rows_leave_the_long_tier_empties_and_keeps_its_memory() -> None:
    tiers, requests = make()
    for serial in range(8):
        requests.add(serial, 4 + serial)
    requests.add(8, 400)
    requests.add(9, 380)
    requests.add(10, 5)
    for serial in range(11, 20):
        requests.add(serial, 3)
    rows = sync(tiers, requests)
    assert sorted(rows[-2:]) == [8, 9]
    held = tiers.long.num_bytes
    requests.remove(8)
    requests.remove(9)
    rows = sync(tiers, requests)
    assert tiers.num_long == 0 and tiers.long.num_bytes == held > 0
    assert_tiers_hold_pool(tiers, requests, rows)
    tiers.release()
    assert tiers.long.num_bytes == 0 and tiers.short.serials == []
