"""The decode batch context's rows leave the positions they all share to its shared prefix: a row
holds its positions from the base on, the prefix the ones before, and joins, leaves, steps and
rebases keep every request's whole KV, bit for bit, between the two."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_service import context_prefix
from decode_service.context_prefix import ContextPrefix
from decode_service.kv_pool import KvPool
from decode_service.step_cache import MIN_SHARED_TOKENS, BatchContext
from pdserve.kv.layout import KvLayout

# Two layers; the second caches keys and values of different widths (as MLA models do).
LAYOUT = KvLayout(keys=((2, 4), (1, 6)), values=((2, 4), (1, 3)), dtype=torch.float32)
PREFIX = 200  # positions of the common prompt requests may share


class Requests:
    """Requests whose first positions are a common prompt's KV, then their own, in pool blocks."""

    def __init__(self, pool: KvPool, seed: int = 0) -> None:
        self.pool = pool
        self.generator = torch.Generator().manual_seed(seed)
        self.shapes = (*LAYOUT.keys, *LAYOUT.values)
        self.common = [torch.randn(h, PREFIX, w, generator=self.generator) for h, w in self.shapes]
        self.blocks: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.shares: dict[int, int] = {}

    def add(self, serial: int, shares: int, own: int) -> None:
        """A request whose first ``shares`` positions are the common prompt's, then ``own`` of its own."""
        tensors = [
            torch.cat([common[:, :shares], torch.randn(h, own, w, generator=self.generator)], 1)
            for common, (h, w) in zip(self.common, self.shapes, strict=True)
        ]
        n = LAYOUT.num_layers
        kv = list(zip(tensors[:n], tensors[n:], strict=True))
        self.blocks[serial] = self.pool.allocate(shares + own + 64)
        self.lengths[serial] = self.pool.write(self.blocks[serial], kv)
        self.shares[serial] = shares

    def remove(self, serial: int) -> None:
        self.pool.free(self.blocks.pop(serial))
        del self.lengths[serial], self.shares[serial]

    def sync(self, context: BatchContext, share: bool = True) -> list[int]:
        serials = list(self.blocks)
        order = context.sync(
            serials, [self.blocks[s] for s in serials], [self.lengths[s] for s in serials], share
        )
        return [serials[i] for i in order]

    def step(self, context: BatchContext) -> None:
        """What a step's cache does: each row's new position written to its pool slot and its row."""
        for row, serial in enumerate(context.serials):
            position = self.lengths[serial]
            slot = self.pool.slot(self.blocks[serial], position)
            for pool_t, t in zip(
                (*self.pool.keys, *self.pool.values), (*context.keys, *context.values), strict=True
            ):
                new = torch.randn(pool_t.shape[1:], generator=self.generator)
                pool_t[slot] = new
                t[row, position - context.base] = new
            self.lengths[serial] += 1

    def assert_context_holds_pool(self, context: BatchContext, rows: list[int]) -> None:
        assert context.serials == rows
        base = context.base
        prefix = (*context.prefix.keys, *context.prefix.values)
        for row, serial in enumerate(rows):
            n = self.lengths[serial]
            assert base <= n - 1
            own = self.pool.slots(self.blocks[serial], base, n - base)
            shared = self.pool.slots(self.blocks[serial], 0, base)
            for i, (pool_t, t) in enumerate(
                zip((*self.pool.keys, *self.pool.values), (*context.keys, *context.values), strict=True)
            ):
                assert torch.equal(t[row, : n - base], pool_t[own])
                if base:
                    assert torch.equal(prefix[i][:, :base], pool_t[shared].transpose(0, 1))


def make(max_rows: int = 64) -> tuple[BatchContext, Requests]:
    pool = KvPool(LAYOUT, num_blocks=1024, block_size=4, device=torch.device("cpu"))
    return BatchContext(pool, max_rows=max_rows, share=True), Requests(pool)


def test_rows_over_a_common_prompt_hold_only_their_own_positions() -> None:
    context, requests = make()
    for serial in range(6):
        requests.add(serial, PREFIX, 3 + serial)
    rows = requests.sync(context)
    assert context.base == context.shared_length() == PREFIX
    requests.assert_context_holds_pool(context, rows)
    assert context.capacity < PREFIX  # the rows' own positions and the next step's only
    for _ in range(3):
        requests.step(context)
        rows = requests.sync(context)
        requests.assert_context_holds_pool(context, rows)


def test_one_row_leaves_all_but_its_last_cached_position_to_the_prefix() -> None:
    context, requests = make()
    requests.add(0, PREFIX, 5)
    rows = requests.sync(context)
    assert context.base == PREFIX + 5 - 1
    requests.assert_context_holds_pool(context, rows)
    requests.add(1, PREFIX, 2)  # shares the common prompt only: the base goes down to it
    rows = requests.sync(context)
    assert context.base == PREFIX
    requests.assert_context_holds_pool(context, rows)


def test_a_row_that_shares_nothing_brings_the_base_to_zero_and_its_leave_brings_it_back() -> None:
    context, requests = make()
    for serial in range(3):
        requests.add(serial, PREFIX, 4)
    requests.sync(context)
    requests.add(3, 0, 30)
    rows = requests.sync(context)
    assert context.base == context.shared_length() == 0
    requests.assert_context_holds_pool(context, rows)
    requests.step(context)
    requests.remove(3)
    rows = requests.sync(context)
    assert context.base == PREFIX
    requests.assert_context_holds_pool(context, rows)


def test_a_context_that_does_not_share_keeps_whole_rows() -> None:
    pool = KvPool(LAYOUT, num_blocks=1024, block_size=4, device=torch.device("cpu"))
    context, requests = BatchContext(pool, max_rows=8), Requests(pool)
    for serial in range(3):
        requests.add(serial, PREFIX, 4)
    rows = requests.sync(context)
    assert context.base == 0
    requests.assert_context_holds_pool(context, rows)
    shared = BatchContext(pool, max_rows=8, share=True)
    requests.sync(shared)
    assert shared.base == PREFIX
    rows = requests.sync(shared, share=False)  # a step with long rows apart: whole rows
    assert shared.base == 0
    requests.assert_context_holds_pool(shared, rows)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("join"), st.integers(0, PREFIX), st.integers(1, 24)),
            st.tuples(st.just("leave"), st.integers(0, 10), st.just(0)),
            st.tuples(st.just("step"), st.just(0), st.just(0)),
            st.tuples(st.just("apart"), st.just(0), st.just(0)),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_every_request_keeps_its_whole_kv_through_any_joins_leaves_and_steps(
    ops: list[tuple[str, int, int]],
) -> None:
    context, requests = make(max_rows=8)
    pool = requests.pool
    serial = 0
    for op, a, b in ops:
        share = True
        if op == "join" and len(requests.blocks) < 8:
            requests.add(serial, a, b)
            serial += 1
        elif op == "leave" and requests.blocks:
            requests.remove(list(requests.blocks)[a % len(requests.blocks)])
        elif op == "apart":
            share = False
        if not requests.blocks:
            continue
        rows = requests.sync(context, share)
        requests.assert_context_holds_pool(context, rows)
        assert context.base == 0 or context.base >= MIN_SHARED_TOKENS
        if len(rows) > 1:
            assert context.base <= min(requests.shares[s] for s in rows)
        if op == "step":
            requests.step(context)
    assert pool.num_free_blocks + sum(len(b) for b in requests.blocks.values()) == pool.num_blocks


def _keyed(pool: KvPool, common: list[torch.Tensor], instance: str, own: int, seed: int) -> list[int]:
    """A request over the common KV, its full prompt blocks keyed by prefill ``instance``."""
    generator = torch.Generator().manual_seed(seed)
    tensors = [
        torch.cat([c, torch.randn(c.shape[0], own, c.shape[2], generator=generator)], 1) for c in common
    ]
    length = tensors[0].shape[1]
    keys = [(instance, i) for i in range(length // pool.block_size)]
    blocks, shared = pool.admit(length, keys)
    n = LAYOUT.num_layers
    pool.write(blocks, list(zip(tensors[:n], tensors[n:], strict=True)), shared)
    return blocks


def test_blocks_of_another_prefill_found_equal_are_known_by_their_keys_from_then_on() -> None:
    pool = KvPool(LAYOUT, num_blocks=256, block_size=4, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    common = [torch.randn(h, 20, w, generator=generator) for h, w in (*LAYOUT.keys, *LAYOUT.values)]
    prefix = ContextPrefix(pool)
    prefix.adopt(_keyed(pool, common, "prefill-a", 4, seed=2), 24)
    # The same prompt from another prefill: its blocks' KV is read and found equal.
    assert prefix.measure(_keyed(pool, common, "prefill-b", 4, seed=3), 24, MIN_SHARED_TOKENS) == 20
    assert prefix.num_positions_read == 24
    # Another request over that prefill's same blocks: only its own block is read.
    assert prefix.measure(_keyed(pool, common, "prefill-b", 4, seed=4), 24, MIN_SHARED_TOKENS) == 20
    assert prefix.num_positions_read == 24 + 4
    # A request over another prompt is read one block's worth and found to share nothing.
    other = [torch.randn(c.shape, generator=generator) for c in common]
    assert prefix.measure(_keyed(pool, other, "prefill-c", 4, seed=5), 24, MIN_SHARED_TOKENS) == 0
    assert prefix.num_positions_read == 24 + 4 + 4
    # A new prefix forgets what was known equal to the old one.
    prefix.adopt(_keyed(pool, other, "prefill-c", 4, seed=6), 24)
    before = prefix.num_positions_read
    assert prefix.measure(_keyed(pool, common, "prefill-b", 4, seed=7), 24, MIN_SHARED_TOKENS) == 0
    assert prefix.num_positions_read == before + 4


def test_a_key_known_equal_at_one_place_is_not_taken_at_another() -> None:
    pool = KvPool(LAYOUT, num_blocks=256, block_size=4, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(8)
    block = [torch.randn(h, 4, w, generator=generator) for h, w in (*LAYOUT.keys, *LAYOUT.values)]
    twice = [torch.cat([b, b], 1) for b in block]  # the same KV in the first two blocks
    prefix = ContextPrefix(pool)
    prefix.adopt(_keyed(pool, twice, "prefill-a", 0, seed=9), 8)
    first = _keyed(pool, block, "prefill-b", 4, seed=10)  # its block 0 equals the prefix's
    assert prefix.measure(first, 8, 4) == 4
    # A request whose block 1 is prefill-b's block 0: equal in KV, but known only where it was seen.
    second = [first[0], first[0]]
    before = prefix.num_positions_read
    assert prefix.measure(second, 8, 4) == 8
    assert prefix.num_positions_read == before + 4
    # Known now at both places: neither is read again.
    assert prefix.measure(second, 8, 4) == 8
    assert prefix.num_positions_read == before + 4


def test_aliases_stay_bounded_however_many_keys_are_found_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(context_prefix, "MAX_ALIASES", 8)
    pool = KvPool(LAYOUT, num_blocks=1024, block_size=4, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(11)
    common = [torch.randn(h, 20, w, generator=generator) for h, w in (*LAYOUT.keys, *LAYOUT.values)]
    prefix = ContextPrefix(pool)
    prefix.adopt(_keyed(pool, common, "prefill-a", 4, seed=12), 24)
    for n in range(20):  # every request from a prefill of its own: 5 new keys found equal each
        blocks = _keyed(pool, common, f"prefill-{n}", 4, seed=13 + n)
        assert prefix.measure(blocks, 24, MIN_SHARED_TOKENS) == 20
        assert len(prefix._aliases) <= 8
        pool.free(blocks)
