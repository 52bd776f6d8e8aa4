"""The prefix cache alone: chained block hashes, references, LRU eviction and its bound; and the
chunk schedule of a prefill step."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.sampling import SamplingParams
from pdserve.kv.layout import KvLayout
from prefill_service.chunk_schedule import Chunk, Group, schedule, split
from prefill_service.prefix_cache import LayerKv, PrefixCache, block_hashes
from prefill_service.prompt_job import PromptJob

# One layer: keys of 2 heads x 3, values of 2 heads x 5 (as MLA, keys and values differ).
LAYOUT = KvLayout(keys=((2, 3),), values=((2, 5),), dtype=torch.float32)


def new_cache(block_size: int, capacity: int, **kwargs: Any) -> PrefixCache:
    return PrefixCache(block_size, capacity, LAYOUT, torch.device("cpu"), **kwargs)


def blocks_kv(num_blocks: int, block_size: int = 4) -> LayerKv:
    """KV of ``num_blocks`` blocks; every token of block i holds i in its keys, -i in its values."""
    values = torch.arange(num_blocks, dtype=torch.float32).repeat_interleave(block_size)
    return [(values[None, :, None].expand(2, -1, 3), -values[None, :, None].expand(2, -1, 5))]


def insert(cache: PrefixCache, hashes: list[bytes], kv: LayerKv) -> list[int | None]:
    return cache.insert(hashes, kv)


def fill(cache: PrefixCache, prompt: list[int]) -> list[bytes]:
    hashes = cache.hashes(prompt)
    insert(cache, hashes, blocks_kv(len(hashes), cache.block_size))
    return hashes


def test_hashes_are_chained_over_full_blocks() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # the 9th token is no full block
    assert a == block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1], "block 1's hash ignores block 0"
    assert block_hashes([5, 6, 7, 8, 1, 2, 3, 4], 4)[1] != a[0]
    assert block_hashes([1, 2, 3], 4) == []
    assert len(set(block_hashes(list(range(64)), 4))) == 16


def test_lookup_takes_the_longest_cached_start_but_never_the_last_token() -> None:
    cache = new_cache(4, 64)
    prompt = list(range(100, 112))
    fill(cache, prompt)
    assert cache.num_tokens == 12
    assert cache.lookup(cache.hashes(prompt), len(prompt)).num_tokens == 8  # the last token runs
    longer = [*prompt, 7]
    assert cache.lookup(cache.hashes(longer), len(longer)).num_tokens == 12
    mid_block = [*prompt[:6], 1, 2, 3]
    match = cache.lookup(cache.hashes(mid_block), len(mid_block))
    assert match.num_tokens == 4
    keys, values = cache.kv(match)[0]
    assert keys.shape == (2, 4, 3) and values.shape == (2, 4, 5) and not keys.any() and not values.any()
    other = [1, *prompt[1:]]
    assert cache.lookup(cache.hashes(other), len(other)).num_tokens == 0


def test_kv_of_a_match_is_its_blocks_in_order() -> None:
    cache = new_cache(4, 64)
    prompt = list(range(13))
    fill(cache, prompt)
    keys, values = cache.kv(cache.lookup(cache.hashes(prompt), len(prompt)))[0]
    assert keys.shape == (2, 12, 3) and values.shape == (2, 12, 5)
    assert keys[1, :, 2].tolist() == [0.0] * 4 + [1.0] * 4 + [2.0] * 4
    assert values[0, :, 4].tolist() == [-0.0] * 4 + [-1.0] * 4 + [-2.0] * 4


def test_an_evicted_slot_holds_the_new_block() -> None:
    cache = new_cache(4, 4)  # one block
    a, b = list(range(5)), list(range(10, 15))
    fill(cache, a)
    insert(cache, cache.hashes(b), [(k + 7, v - 7) for k, v in blocks_kv(1)])
    keys, values = cache.kv(cache.lookup(cache.hashes(b), len(b)))[0]
    assert keys.eq(7).all() and values.eq(-7).all()
    assert cache.lookup(cache.hashes(a), len(a)).num_tokens == 0


def test_blocks_are_copied_in_at_the_next_flush_and_a_lookup_flushes_first() -> None:
    """The engine answers a forward's prompts before their blocks are copied into the cache; the
    copy reads the KV as it is at ``flush`` (and never later), and a lookup never sees a block whose
    copy is still to come."""
    cache = new_cache(4, 16)
    a, b = list(range(9)), list(range(20, 29))
    source = [(k.clone(), v.clone()) for k, v in blocks_kv(2)]
    ids = insert(cache, cache.hashes(a), source)
    assert all(i is not None for i in ids) and cache.num_tokens == 8  # known at once
    source[0][0].add_(10)  # the KV the copy reads when it runs
    cache.flush()
    source[0][0].add_(100)  # after the flush: the cache keeps its copy
    keys, _ = cache.kv(cache.lookup(cache.hashes(a), len(a)))[0]
    assert keys[0, :, 0].tolist() == [10.0] * 4 + [11.0] * 4

    insert(cache, cache.hashes(b), [(k + 5, v - 5) for k, v in blocks_kv(2)])  # no flush by hand
    keys, values = cache.kv(cache.lookup(cache.hashes(b), len(b)))[0]
    assert keys[1, :, 2].tolist() == [5.0] * 4 + [6.0] * 4
    assert values[0, :, 0].tolist() == [-5.0] * 4 + [-6.0] * 4


def test_a_copy_that_fails_leaves_its_blocks_and_the_later_ones_out() -> None:
    cache = new_cache(4, 32)
    a, b, c = list(range(9)), list(range(20, 29)), list(range(40, 49))
    fill(cache, a)
    cache.flush()
    bad = [(k[:, :, :2], v) for k, v in blocks_kv(2)]  # keys 2 wide where the pool's are 3
    insert(cache, cache.hashes(b), bad)
    fill(cache, c)
    with pytest.raises(RuntimeError):
        cache.flush()
    assert cache.num_tokens == 8  # a's two blocks, copied before
    assert cache.lookup(cache.hashes(a), len(a)).num_tokens == 8
    assert cache.lookup(cache.hashes(b), len(b)).num_tokens == 0
    assert cache.lookup(cache.hashes(c), len(c)).num_tokens == 0
    fill(cache, c)  # offered again, cached again
    keys, _ = cache.kv(cache.lookup(cache.hashes(c), len(c)))[0]
    assert keys[0, :, 0].tolist() == [0.0] * 4 + [1.0] * 4


def test_each_block_cached_has_an_id_of_its_own() -> None:
    cache = new_cache(4, 8)  # two blocks
    a = list(range(9))
    ids = insert(cache, cache.hashes(a), blocks_kv(2))
    assert len(ids) == 2 and None not in ids and len(set(ids)) == 2
    assert insert(cache, cache.hashes(a), blocks_kv(2)) == [None, None], "cached already: not this KV"
    match = cache.lookup(cache.hashes(a), len(a))
    assert [block.uid for block in match.blocks] == ids
    cache.release(match)
    fill(cache, list(range(50, 59)))  # evicts both
    again = insert(cache, cache.hashes(a), blocks_kv(2))
    assert None not in again and not set(again) & set(ids), "a block computed again got an old id"


def test_a_prompts_block_ids_run_while_the_cache_holds_its_own_kv() -> None:
    cache = new_cache(4, 64)
    a = list(range(13))  # 3 full blocks
    fill(cache, a)
    job = PromptJob([*a[:8], 99, 98, 97, 96, 95], SamplingParams(max_tokens=2), 0, None)
    job.begin(cache, 0.0)
    hit = [block.uid for block in job.match.blocks] if job.match else []
    assert len(hit) == 2 and job.block_ids == hit
    new = job.ran(job.remaining, cache)
    assert [index for _, index in new] == [2]
    job.cached(2, insert(cache, [h for h, _ in new], blocks_kv(1)))
    assert len(job.block_ids) == 3 and job.block_ids[:2] == hit
    other = PromptJob(list(a), SamplingParams(max_tokens=2), 0, None)
    other.hashes = cache.hashes(a)
    other.cached(0, [5, None, 7])  # its second block's KV came from elsewhere: the run ends there
    assert other.block_ids == [5]
    other.cached(2, [8])
    assert other.block_ids == [5]


def test_referenced_blocks_are_never_evicted_and_the_bound_holds() -> None:
    evicted: list[int] = []
    cache = new_cache(4, 8, on_evict=evicted.append)  # two blocks
    a = list(range(9))
    fill(cache, a)
    held = cache.lookup(cache.hashes(a), len(a))
    assert held.num_tokens == 8 and cache.num_referenced_blocks == 2
    b = list(range(50, 59))
    assert fill(cache, b) and cache.num_tokens == 8, "a block was cached over the bound"
    assert cache.lookup(cache.hashes(b), len(b)).num_tokens == 0
    assert evicted == []
    cache.release(held)
    cache.release(held)  # a second release gives nothing back twice
    assert cache.num_referenced_blocks == 0
    fill(cache, b)
    assert cache.num_tokens == 8 and evicted == [4, 4]
    assert cache.lookup(cache.hashes(b), len(b)).num_tokens == 8


def test_eviction_is_least_recently_used_and_a_prompts_last_blocks_first() -> None:
    cache = new_cache(4, 16)  # four blocks
    a, b = list(range(9)), list(range(40, 49))
    fill(cache, a)
    fill(cache, b)
    cache.release(cache.lookup(cache.hashes(a), len(a)))  # a is now the most recently used
    c = list(range(80, 85))
    fill(cache, c)  # evicts b's last block, not b's first nor a's
    assert cache.lookup(cache.hashes(b), len(b)).num_tokens == 4
    assert cache.lookup(cache.hashes(a), len(a)).num_tokens == 8


def test_blocks_in_scattered_slots_come_back_in_order() -> None:
    cache = new_cache(4, 16)  # four blocks
    a, b = list(range(9)), list(range(20, 29))
    fill(cache, a)
    fill(cache, b)
    cache.release(cache.lookup(cache.hashes(a), len(a)))  # b's blocks are evicted first
    c = list(range(40, 53))  # 3 blocks: b's two slots, then a's last one
    fill(cache, c)
    keys, values = cache.kv(cache.lookup(cache.hashes(c), len(c)))[0]
    assert keys[0, :, 0].tolist() == [0.0] * 4 + [1.0] * 4 + [2.0] * 4
    assert values[1, :, 4].tolist() == [-0.0] * 4 + [-1.0] * 4 + [-2.0] * 4
    assert cache.lookup(cache.hashes(a), len(a)).num_tokens == 4


def touch(cache: PrefixCache, prompt: list[int]) -> None:
    """Makes ``prompt``'s cached blocks the most recently used."""
    cache.release(cache.lookup(cache.hashes(prompt), len(prompt)))


def one_block_prompts(count: int, block_size: int = 4) -> list[list[int]]:
    """Prompts of one full block each (and a last token), all different."""
    return [list(range(100 * i, 100 * i + block_size + 1)) for i in range(count)]


def test_a_full_cache_puts_a_new_prompts_blocks_in_consecutive_slots() -> None:
    evicted: list[int] = []
    cache = new_cache(4, 24, on_evict=evicted.append)  # six blocks
    p = one_block_prompts(6)
    for prompt in p:
        fill(cache, prompt)  # slots 0..5, least recently used first
    for i in (1, 3, 5):
        touch(cache, p[i])  # LRU order now p0 p2 p4 p1 p3 p5: the oldest two are not neighbours
    d = list(range(2000, 2009))
    fill(cache, d)
    # The run of two slots whose newer block is the oldest: p0 and p1, not the scattered p0 and p2.
    assert evicted == [4, 4]
    assert [cache.lookup(cache.hashes(q), len(q)).num_tokens for q in p] == [0, 0, 4, 4, 4, 4]
    match = cache.lookup(cache.hashes(d), len(d))
    assert match.num_tokens == 8
    keys, values = cache.kv(match)[0]
    assert keys._is_view() and values._is_view()  # read in place, not gathered
    assert keys[0, :, 0].tolist() == [0.0] * 4 + [1.0] * 4


def test_a_prompts_later_blocks_follow_its_earlier_ones() -> None:
    def second_half_lands_after_the_first(after: bool) -> bool:
        cache = new_cache(4, 32)  # eight blocks
        p = one_block_prompts(8)
        for prompt in p:
            fill(cache, prompt)
        touch(cache, p[0])
        touch(cache, p[1])
        x = list(range(2000, 2017))  # four blocks, offered two at a time (two chunks)
        hashes = cache.hashes(x)
        assert insert(cache, hashes[:2], blocks_kv(2)) != [None, None]  # p2 and p3's slots
        for q in (p[4], p[5]):
            touch(cache, q)  # the oldest two slots are now p6 and p7's
        second = blocks_kv(4)
        ids = cache.insert(
            hashes[2:], [(k[:, 8:], v[:, 8:]) for k, v in second], hashes[1] if after else None
        )
        assert None not in ids
        keys, _ = cache.kv(cache.lookup(hashes, len(x)))[0]
        assert keys[0, :, 0].tolist() == [0.0] * 4 + [1.0] * 4 + [2.0] * 4 + [3.0] * 4
        return keys._is_view()

    assert second_half_lands_after_the_first(after=True)
    assert not second_half_lands_after_the_first(after=False)  # the oldest run: gathered on every hit


def test_matches_of_the_same_scattered_blocks_share_one_gathered_copy() -> None:
    cache = new_cache(4, 32)  # eight blocks
    p = one_block_prompts(8)
    for prompt in p:
        fill(cache, prompt)
    held = [cache.lookup(cache.hashes(p[i]), len(p[i])) for i in (1, 3, 5, 7)]  # no two free neighbours
    x = list(range(2000, 2009))
    fill(cache, x)  # the two least recently used: slots 0 and 2
    first, second = (cache.lookup(cache.hashes(x), len(x)) for _ in range(2))
    (a, _), (b, _) = cache.kv(first)[0], cache.kv(second)[0]
    assert not a._is_view() and a.data_ptr() == b.data_ptr() and cache.num_gathered == 1
    cache.release(first)
    assert cache.num_gathered == 1 and b[0, :, 0].tolist() == [0.0] * 4 + [1.0] * 4
    cache.release(second)
    for match in held:
        cache.release(match)
    assert cache.num_gathered == 0


def test_no_capacity_caches_nothing_and_clear_keeps_referenced_blocks() -> None:
    assert insert(new_cache(4, 3), [b"x" * 16], blocks_kv(1)) == [None]
    cache = new_cache(4, 64)
    a, b = list(range(9)), list(range(20, 29))
    fill(cache, a)
    fill(cache, b)
    held = cache.lookup(cache.hashes(a), len(a))
    cache.clear()
    assert cache.num_tokens == 8 and cache.contains(cache.hashes(a)[0])
    cache.release(held)
    cache.clear()
    assert cache.num_tokens == 0


def test_after_clear_a_prompts_blocks_lie_in_consecutive_slots_and_are_not_copied() -> None:
    cache = new_cache(4, 64)
    for start in (0, 20, 40):  # released last block first: evictable in an order of their own
        fill(cache, list(range(start, start + 9)))
    cache.clear()
    prompt = list(range(60, 77))
    fill(cache, prompt)
    match = cache.lookup(cache.hashes(prompt), len(prompt))
    assert match.num_tokens == 16
    (first, _), (again, _) = cache.kv(match)[0], cache.kv(match)[0]
    assert first.untyped_storage().data_ptr() == again.untyped_storage().data_ptr()  # views of the pool
    assert first[0, :, 0].tolist() == [0.0] * 4 + [1.0] * 4 + [2.0] * 4 + [3.0] * 4


def test_a_match_stops_before_a_few_last_blocks_cached_apart() -> None:
    cache = new_cache(4, 64)
    a = list(range(13))
    fill(cache, a)  # slots 0, 1, 2
    fill(cache, list(range(50, 59)))  # slots 3, 4
    again = [*a[:12], 90, 91, 92, 93, 94]
    fill(cache, again)  # its fourth block: slot 5
    match = cache.lookup(cache.hashes(again), len(again))
    assert match.num_tokens == 12  # 3 of 4 blocks in a row: the fourth is computed again
    (first, _), (second, _) = cache.kv(match)[0], cache.kv(match)[0]
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    cache.release(match)


@pytest.mark.parametrize(("block_size", "capacity"), [(0, 8), (4097, 8), (4, -1)])
def test_bad_settings_are_refused(block_size: int, capacity: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        new_cache(block_size, capacity)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=14), st.booleans()),
        min_size=1,
        max_size=30,
    ),
    st.integers(0, 24),
)
def test_the_bound_is_never_exceeded(ops: list[tuple[list[int], bool]], capacity: int) -> None:
    """Prompts of a 4-token alphabet share prefixes often; each is looked up, its blocks inserted,
    and it keeps its references (or not) for a while."""
    cache = new_cache(2, capacity)
    held = []
    for prompt, keep in ops:
        hashes = cache.hashes(prompt)
        match = cache.lookup(hashes, len(prompt))
        assert match.num_tokens <= len(prompt) - 1
        assert [b.block_hash for b in match.blocks] == hashes[: len(match.blocks)]
        insert(cache, hashes, blocks_kv(len(hashes), 2))
        assert cache.num_tokens <= cache.capacity_tokens <= capacity
        (held if keep else []).append(match)
        if not keep:
            cache.release(match)
        if len(held) > 3:
            cache.release(held.pop(0))
        for kept in held:  # a referenced block is never evicted nor overwritten
            if kept.blocks:
                keys, values = cache.kv(kept)[0]
                expected = torch.arange(len(kept.blocks), dtype=torch.float32).repeat_interleave(2)
                assert torch.equal(keys[1, :, 2], expected) and torch.equal(values[0, :, 4], -expected)
    for match in held:
        cache.release(match)
    assert cache.num_referenced_blocks == 0 and cache.num_gathered == 0


def test_schedule_takes_whole_prompts_in_order_within_the_budget() -> None:
    assert schedule([(0, 12), (0, 9), (0, 12), (0, 3), (0, 20)], 48) == [
        Group(0, (Chunk(0, 12), Chunk(1, 9), Chunk(2, 12), Chunk(3, 3)))
    ]
    assert schedule([(0, 20), (0, 20), (0, 1)], 48) == [Group(0, (Chunk(0, 20), Chunk(1, 20)))]
    assert schedule([], 48) == []


def test_schedule_cuts_a_long_prompt_to_what_is_left_and_groups_by_past() -> None:
    assert schedule([(0, 1024)], 512) == [Group(0, (Chunk(0, 512),))]
    # a prompt over 512 cached tokens, then one over none, then the rest of a long one
    assert schedule([(512, 32), (0, 40), (512, 30), (300, 1000)], 512) == [
        Group(512, (Chunk(0, 32), Chunk(2, 30))),
        Group(0, (Chunk(1, 40),)),
        Group(300, (Chunk(3, 408),)),
    ]
    # a padded group leaves a smaller chunk: 3 rows x 12 of the 48
    assert schedule([(0, 12), (0, 12), (0, 100)], 48) == [
        Group(0, (Chunk(0, 12), Chunk(1, 12), Chunk(2, 16)))
    ]
    assert schedule([(0, 12), (0, 12), (0, 12), (0, 100)], 40) == [
        Group(0, (Chunk(0, 12), Chunk(1, 12), Chunk(2, 12)))
    ]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(1, 80)), min_size=1, max_size=12), st.integers(1, 100)
)
def test_schedule_stays_within_the_budget_and_always_moves(line: list[tuple[int, int]], budget: int) -> None:
    groups = schedule(line, budget)
    assert sum(g.cost for g in groups) <= budget
    taken = sorted(c.index for g in groups for c in g.chunks)
    assert taken == list(range(len(taken))) and taken, "not the head of the line, or nothing"
    for g in groups:
        for c in g.chunks:
            assert line[c.index][0] == g.past and 1 <= c.num_tokens <= line[c.index][1]
    cut = [c for g in groups for c in g.chunks if c.num_tokens < line[c.index][1]]
    assert len(cut) <= 1 and (not cut or cut[0].index == taken[-1])


def test_schedule_refuses_a_bad_budget() -> None:
    with pytest.raises(ValueError, match="budget"):
        schedule([(0, 1)], 0)


def test_a_group_splits_into_forwards_of_at_most_the_cost_in_line_order() -> None:
    group = Group(16, (Chunk(0, 32), Chunk(1, 32), Chunk(2, 32), Chunk(3, 64), Chunk(4, 8)))
    parts = split(group, 96)
    assert [[c.index for c in part.chunks] for part in parts] == [[0, 1, 2], [3], [4]]
    assert all(part.past == 16 and part.cost <= 96 for part in parts)
    assert split(Group(0, (Chunk(0, 500),)), 128) == [Group(0, (Chunk(0, 500),))]  # a chunk alone
    assert split(group, 10_000) == [group]
    with pytest.raises(ValueError):
        split(group, 0)


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 300), min_size=1, max_size=12),
    most=st.integers(1, 600),
)
def test_split_keeps_every_chunk_once_and_each_part_within_the_cost(chunks: list[int], most: int) -> None:
    group = Group(3, tuple(Chunk(i, n) for i, n in enumerate(chunks)))
    parts = split(group, most)
    assert [c for part in parts for c in part.chunks] == list(group.chunks)
    assert all(part.cost <= most or len(part.chunks) == 1 for part in parts)
    # Greedy: a part could not have taken the next part's first chunk too.
    for part, after in itertools.pairwise(parts):
        joined = Group(3, (*part.chunks, after.chunks[0]))
        assert joined.cost > most
