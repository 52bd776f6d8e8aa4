"""The gateway's prefix router: longest-prefix hits, balance against load, the bounded index and
replicas leaving; and the gateway's flags that choose it."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import pytest

from gateway.prefix_router import PrefixRouter, block_hashes
from pdserve.config import GatewayConfig, flags
from pdserve.config.prefill_routing import PrefillRouting

BLOCK = 16


@dataclass
class Replica:
    address: str
    outstanding: int = 0
    pending_tokens: int = 0


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


def router(**kwargs: int) -> PrefixRouter:
    return PrefixRouter(PrefillRouting(prefix_block_size=BLOCK, **kwargs))  # type: ignore[arg-type]


def test_block_hashes_chain_full_blocks_only() -> None:
    prompt = tokens(0, 3 * BLOCK + 5)
    hashes = block_hashes(prompt, BLOCK)
    assert len(hashes) == 3
    assert block_hashes(prompt[: 2 * BLOCK], BLOCK) == hashes[:2]
    # The same block after another prefix hashes differently: a hash names the whole prefix.
    other = tokens(1, BLOCK) + prompt[BLOCK : 2 * BLOCK]
    assert block_hashes(other, BLOCK)[1] != hashes[1]
    assert block_hashes(prompt[: BLOCK - 1], BLOCK) == []


def test_requests_sharing_a_prefix_go_where_it_went() -> None:
    r = router()
    a, b = Replica("a"), Replica("b")
    prefix = tokens(0, 8 * BLOCK)
    first, routed = r.choose(prefix + tokens(1, 32), [a, b])
    assert routed.outcome == "least-load" and routed.matched_blocks == 0
    # The other replica is less loaded now, yet the prefix's holder is chosen.
    first.outstanding = 2
    other = b if first is a else a
    for seed in range(2, 6):
        chosen, routed = r.choose(prefix + tokens(seed, 32), [a, b])
        assert chosen is first and routed.outcome == "prefix"
        assert routed.matched_blocks == 8
    assert r.matched_blocks(prefix, other.address) == 0
    # A prompt with no prefix in common goes to the least loaded replica.
    chosen, routed = r.choose(tokens(99, 64), [a, b])
    assert chosen is other and routed.outcome == "least-load"


def test_the_longest_match_wins() -> None:
    r = router()
    a, b = Replica("a"), Replica("b")
    short, long_ = tokens(0, 2 * BLOCK), tokens(0, 6 * BLOCK)
    r.choose(short, [a])
    r.choose(long_, [b])
    assert r.matched_blocks(long_, "a") == 2 and r.matched_blocks(long_, "b") == 6
    a.outstanding, b.outstanding = 0, 3
    chosen, routed = r.choose(long_ + tokens(1, BLOCK), [a, b])
    assert chosen is b and routed.matched_blocks == 6


def test_a_popular_prefix_spreads_once_its_replica_is_loaded() -> None:
    r = router(prefix_balance_threshold=2)
    a, b = Replica("a"), Replica("b")
    prefix = tokens(0, 4 * BLOCK)
    counts = {"a": 0, "b": 0}
    # 16 requests arrive before any ends: each stays outstanding where it went.
    for seed in range(16):
        chosen, _ = r.choose(prefix + tokens(100 + seed, 8), [a, b])
        chosen.outstanding += 1
        counts[chosen.address] += 1
    assert abs(a.outstanding - b.outstanding) <= 3, counts
    # Both now hold the prefix: the next one goes to the less loaded of them, as a prefix hit.
    a.outstanding = 0
    chosen, routed = r.choose(prefix + tokens(7, 8), [a, b])
    assert chosen is a and routed.outcome == "prefix"


def test_the_choice_weighs_the_prompt_work_in_tokens() -> None:
    """A holder of the prefix wins while the work queued on it is less than computing the prefix
    elsewhere; the tokens a replica is expected to compute are what the choice reports."""
    r = router(prefix_balance_threshold=100)
    a, b = Replica("a"), Replica("b")
    prefix = tokens(0, 8 * BLOCK)
    holder, routed = r.choose(prefix + tokens(1, BLOCK), [a, b])
    assert routed.new_tokens == 9 * BLOCK  # nothing cached yet
    other = b if holder is a else a
    holder.outstanding, holder.pending_tokens = 3, 5 * BLOCK
    chosen, routed = r.choose(prefix + tokens(2, BLOCK), [a, b])
    assert chosen is holder and (routed.outcome, routed.new_tokens) == ("prefix", BLOCK)
    # Queued work beyond the prefix's cost: the idle replica computes the prefix instead.
    holder.pending_tokens = 9 * BLOCK
    chosen, routed = r.choose(prefix + tokens(3, BLOCK), [a, b])
    assert chosen is other and (routed.outcome, routed.new_tokens) == ("least-load", 9 * BLOCK)
    # Both hold it now: the one with less work queued.
    other.pending_tokens = 20 * BLOCK
    chosen, routed = r.choose(prefix + tokens(4, BLOCK), [a, b])
    assert chosen is holder and (routed.outcome, routed.new_tokens) == ("prefix", BLOCK)
    # With no prefix in common, the replica with the least work queued in tokens.
    chosen, _ = r.choose(tokens(5, 3 * BLOCK), [a, b])
    assert chosen is holder


def test_the_index_is_bounded_and_evicts_tails_first() -> None:
    r = router(prefix_index_blocks=10)
    a = Replica("a")
    prefix = tokens(0, 4 * BLOCK)
    r.choose(prefix, [a])
    for seed in range(1, 20):
        r.choose(tokens(seed, 4 * BLOCK), [a])
        r.choose(prefix + tokens(1000 + seed, 2 * BLOCK), [a])  # the shared prefix stays in use
        assert r.num_blocks <= 10
    assert r.matched_blocks(prefix, "a") == 4
    assert r.matched_blocks(tokens(1, 4 * BLOCK), "a") == 0  # an old one-off prompt is gone


def test_a_replica_that_left_is_forgotten_and_a_new_one_is_used() -> None:
    r = router()
    a, b, c = Replica("a"), Replica("b"), Replica("c")
    prefix = tokens(0, 4 * BLOCK)
    first, _ = r.choose(prefix, [a, b])
    r.forget(first.address)
    assert r.matched_blocks(prefix, first.address) == 0
    assert r.num_blocks == 0
    survivor = b if first is a else a
    survivor.outstanding = 1
    chosen, routed = r.choose(prefix, [survivor, c])
    assert chosen is c and routed.outcome == "least-load"
    # Only the candidates offered count: a holder that is not serving is not chosen.
    chosen, _ = r.choose(prefix, [survivor])
    assert chosen is survivor


def test_no_candidate_is_an_error() -> None:
    with pytest.raises(ValueError):
        router().choose(tokens(0, BLOCK), [])


def parse_gateway(*args: str) -> GatewayConfig:
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser, GatewayConfig, env={})
    return flags.build(GatewayConfig, parser.parse_args(["--prefill", "h:1", "--decode", "h:2", *args]))


def test_gateway_flags_choose_the_routing() -> None:
    assert parse_gateway().routing == PrefillRouting()
    assert parse_gateway().routing.prefill_routing == "prefix"
    config = parse_gateway("--prefill-routing", "least-load", "--prefix-block-size", "32")
    assert config.routing.prefill_routing == "least-load" and config.routing.prefix_block_size == 32
    for bad in (
        ["--prefill-routing", "random"],
        ["--prefix-block-size", "0"],
        ["--prefix-index-blocks", "-1"],
        ["--prefix-balance-threshold", "-1"],
    ):
        with pytest.raises(ValueError):
            parse_gateway(*bad)


def test_a_replica_holds_no_more_blocks_than_its_cache() -> None:
    """Once a replica's capacity is known, its least recently routed blocks leave its part of the
    index as new ones come: an evicted prefix no longer counts as held there."""
    r = router()
    a = Replica("a")
    p1, p2, p3 = (tokens(seed, 4 * BLOCK) for seed in (1, 2, 3))
    for prompt in (p1, p2, p3):
        r.choose(prompt, [a])
    assert [r.matched_blocks(p, "a") for p in (p1, p2, p3)] == [4, 4, 4]  # capacity not known yet
    r.learn_capacity("a", 8 * BLOCK + 5)  # 8 whole blocks
    assert [r.matched_blocks(p, "a") for p in (p1, p2, p3)] == [0, 4, 4]
    r.choose(p2, [a])  # p2 used again: p3 is now the least recently routed
    r.choose(p1, [a])
    assert [r.matched_blocks(p, "a") for p in (p1, p2, p3)] == [4, 4, 0]
    assert r.num_blocks == 8
    r.learn_capacity("a", 0)  # no cache at all
    assert r.num_blocks == 0 and r.choose(p1, [a])[1].matched_blocks == 0
    r.learn_capacity("a", 8 * BLOCK)
    r.forget("a")
    assert r.num_blocks == 0


def test_a_prompt_goes_where_its_blocks_evict_no_prefix_in_use() -> None:
    """Equal load and no match anywhere: the replica whose cache would lose blocks that prompts were
    routed over again (a prefix in use) is passed over for one that would lose one-off blocks only;
    a replica with room loses nothing."""
    r = router(prefix_balance_threshold=100)
    a, b = Replica("a"), Replica("b")
    for replica in (a, b):
        r.learn_capacity(replica.address, 8 * BLOCK)
    in_use = [tokens(seed, 4 * BLOCK) for seed in (1, 2)]
    for prefix in in_use * 2:
        r.choose(prefix, [a])
    for seed in (3, 4):
        r.choose(tokens(seed, 4 * BLOCK), [b])
    for seed in (5, 6, 7):
        chosen, routed = r.choose(tokens(seed, 4 * BLOCK), [a, b])
        assert chosen is b and routed.outcome == "least-load"
    assert [r.matched_blocks(p, "a") for p in in_use] == [4, 4]
    # Work still counts first: with more queued on b than the prefix a would lose, a takes it.
    b.pending_tokens = 5 * BLOCK
    chosen, _ = r.choose(tokens(8, 4 * BLOCK), [a, b])
    assert chosen is a
    # Room left: nothing is evicted, the least loaded replica as before.
    c = Replica("c")
    r.learn_capacity("c", 64 * BLOCK)
    chosen, _ = r.choose(tokens(9, 4 * BLOCK), [a, b, c])
    assert chosen is c


def test_a_capacity_beyond_the_index_leaves_the_index_bounded() -> None:
    """A prefill announcing the largest capacity its answer can carry: the index stays within
    ``--prefix-index-blocks``, and the replica's own blocks with it."""
    r = router(prefix_index_blocks=10)
    a = Replica("a")
    r.learn_capacity("a", (1 << 32) - 1)
    for seed in range(8):
        r.choose(tokens(seed, 4 * BLOCK), [a])
        assert r.num_blocks <= 10
    assert r.matched_blocks(tokens(7, 4 * BLOCK), "a") == 4
    assert r.matched_blocks(tokens(0, 4 * BLOCK), "a") == 0
