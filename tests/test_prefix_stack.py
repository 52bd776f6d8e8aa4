"""The prefix cache and chunked prefill through a real stack: outputs equal ``model.generate`` token
for token while prompts share prefixes, run in chunks and evict each other, and the prefill's
metrics count the cached tokens; the decode (blocks of the prefix cache's size) takes the prompt
blocks it holds already instead of copying them. The cache is on by default; ``--no-prefix-cache``
turns it off."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.config import PrefillConfig
from pdserve.kv.host_memory import host_memory_bytes
from pdserve.v1 import kv_pb2
from prefill_service.metrics import PrefillMetrics
from prefill_service.server import build_prefix_cache
from tests.conftest import StackPool, assert_no_leaks
from tests.engine_models import eager_engine_model
from tests.grpc_client import generate, make_request, run
from tests.stack import Stack, scrape
from tests.test_equivalence import reference_tokens
from tests.test_handles import decode as decode_directly
from tests.test_handles import prefill as prefill_directly

MODEL = "tiny-llama"
BLOCK = 8
CAPACITY = 64  # 8 blocks
ARGS = ["--prefix-block-size", str(BLOCK), "--prefix-cache-tokens", str(CAPACITY), "--max-batch-tokens", "48"]
DECODE_ARGS = ["--kv-block-size", str(BLOCK)]
SHARED = "pdserve_decode_kv_shared_tokens_total"


@pytest.fixture(scope="module")
def stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    started = Stack(
        MODEL, cache_dir, tmp_path_factory.mktemp("prefix-logs"), prefill_args=ARGS, decode_args=DECODE_ARGS
    ).start()
    yield started
    started.stop()


def prefill_metrics(stack: Stack) -> dict[str, float]:
    return scrape(stack.prefills[0].metrics)


def decode_metrics(stack: Stack) -> dict[str, float]:
    return scrape(stack.decodes[0].metrics)


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_shared_prefixes_hit_and_stay_exact(stack: Stack, reference_models: Any) -> None:
    model, _ = reference_models(MODEL)
    system = prompt(1, 30)  # 3 full blocks, and 6 tokens more
    before, decode_before = prefill_metrics(stack), decode_metrics(stack)
    prompts = [[*system, *prompt(10 + i, 5)] for i in range(3)]
    reported = []
    for p in prompts:
        result = run(stack.address, make_request(prompt_token_ids=p, max_tokens=6, temperature=0.0))
        assert result.token_ids == reference_tokens(model, p, 6)
        reported.append(result.chunks[0].num_cached_tokens)
    whole = run(stack.address, make_request(prompt_token_ids=prompts[0], max_tokens=1, temperature=0.0))
    assert whole.token_ids == reference_tokens(model, prompts[0], 1)
    assert [*reported, whole.chunks[0].num_cached_tokens] == [0, 24, 24, 32]  # set on the first message
    after = prefill_metrics(stack)
    queries = (
        after["pdserve_prefill_prefix_cache_queries_total"]
        - before["pdserve_prefill_prefix_cache_queries_total"]
    )
    hits = (
        after["pdserve_prefill_prefix_cache_hits_total"] - before["pdserve_prefill_prefix_cache_hits_total"]
    )
    assert queries == 4 * 35
    assert hits == 24 + 24 + 32  # the first caches the prefix; the last reads all but its last token
    cached = after["pdserve_prefill_cached_tokens_count"] - before["pdserve_prefill_cached_tokens_count"]
    assert cached == 4
    assert after["pdserve_prefill_prefix_cache_capacity_tokens"] == CAPACITY
    assert 0 < after["pdserve_prefill_prefix_cache_tokens"] <= CAPACITY
    # The second and third requests' first 3 blocks were the first's in the decode's pool too; the
    # last ended at its first token and never reached the decode.
    decode_after = decode_metrics(stack)
    assert decode_after[SHARED] - decode_before[SHARED] == 24 + 24
    assert decode_after["pdserve_decode_kv_blocks_idle"] > 0
    assert_no_leaks(stack)


def test_requests_running_together_share_their_prefix_blocks_in_the_decode(
    stack: Stack, reference_models: Any
) -> None:
    """One request leaves a system prompt's blocks in both caches; then requests over it run at
    once, each taking, in the decode, the blocks its prefill took from the cache."""
    model, _ = reference_models(MODEL)
    system = prompt(20, 17)  # 2 full blocks, and 1 token more
    first = [*system, *prompt(21, 4)]
    assert run(
        stack.address, make_request(prompt_token_ids=first, max_tokens=3, temperature=0.0)
    ).token_ids == (reference_tokens(model, first, 3))
    prompts = [[*system, *prompt(22 + i, 3 + i)] for i in range(4)]

    async def run_all() -> list[Any]:
        requests = [make_request(prompt_token_ids=p, max_tokens=12, temperature=0.0) for p in prompts]
        return list(await asyncio.gather(*(generate(stack.address, q) for q in requests)))

    before = decode_metrics(stack)
    results = asyncio.run(run_all())
    assert [r.token_ids for r in results] == [reference_tokens(model, p, 12) for p in prompts]
    cached = sum(r.chunks[0].num_cached_tokens for r in results)
    assert cached > 0, "no request found the system prompt in the prefill's cache"
    assert decode_metrics(stack)[SHARED] - before[SHARED] == cached
    assert_no_leaks(stack)


def test_a_handle_rewritten_to_name_blocks_of_another_prompt_shares_nothing(
    stack: Stack, reference_models: Any
) -> None:
    """A caller of the internal API rewrites its handle's block ids to guess those of a prompt the
    decode holds (the ids just before its own, as a count would have given them, and the first ids),
    or those the next prompts will get (to leave its KV under them). Block ids are no count: the
    decode holds no block of those ids, copies the handle's whole KV, and the tokens are the prompt's
    own; the other prompt, run again, still gets its own."""
    model, _ = reference_models(MODEL)
    victim = prompt(70, 33)  # 4 full blocks of 8
    expected_victim = reference_tokens(model, victim, 4)
    assert run(
        stack.address, make_request(prompt_token_ids=victim, max_tokens=4, temperature=0.0)
    ).token_ids == (expected_victim)
    mine = prompt(71, 33)
    expected = reference_tokens(model, mine, 8)
    before = decode_metrics(stack)
    for guess in ("before", "first", "after"):
        response = asyncio.run(prefill_directly(stack, mine))
        assert response.prefix_cache_tokens == CAPACITY  # what a gateway's prefix router learns
        handle = kv_pb2.KvHandle()
        handle.CopyFrom(response.kv_handle)
        own = list(handle.block_ids)
        assert len(own) == 4 and handle.block_size == BLOCK
        forged = {
            "before": [(own[0] - 4 + i) % (1 << 64) for i in range(4)],
            "first": [1, 2, 3, 4],
            "after": [(max(own) + 1 + i) % (1 << 64) for i in range(4)],
        }[guess]
        del handle.block_ids[:]
        handle.block_ids.extend(forged)
        tokens = [
            response.first_token_id,
            *asyncio.run(decode_directly(stack, handle, response.first_token_id)),
        ]
        assert tokens == expected, guess
    assert decode_metrics(stack)[SHARED] == before[SHARED]
    again = run(stack.address, make_request(prompt_token_ids=victim, max_tokens=4, temperature=0.0))
    assert again.token_ids == expected_victim
    assert_no_leaks(stack)


def test_chunked_prompts_and_evictions_stay_exact(stack: Stack, reference_models: Any) -> None:
    """Prompts longer than the budget (48) arrive together with short ones sharing their starts;
    their blocks overflow the 64-token cache."""
    model, _ = reference_models(MODEL)
    long = prompt(2, 100)
    prompts = [long, [*long[:20], *prompt(3, 4)], prompt(4, 90), [*long[:50], *prompt(5, 3)], prompt(6, 7)]

    async def run_all() -> list[list[int]]:
        requests = [make_request(prompt_token_ids=p, max_tokens=5, temperature=0.0) for p in prompts]
        return [r.token_ids for r in await asyncio.gather(*(generate(stack.address, q) for q in requests))]

    before = prefill_metrics(stack)
    assert asyncio.run(run_all()) == [reference_tokens(model, p, 5) for p in prompts]
    again = [*long[:50], *prompt(7, 2)]  # after the evictions, whatever is left of the long prompt
    result = run(stack.address, make_request(prompt_token_ids=again, max_tokens=5, temperature=0.0))
    assert result.token_ids == reference_tokens(model, again, 5)
    after = prefill_metrics(stack)
    evicted = "pdserve_prefill_prefix_cache_evicted_tokens_total"
    assert after[evicted] > before[evicted], "the prompts did not overflow the cache"
    assert after["pdserve_prefill_prefix_cache_tokens"] <= CAPACITY
    assert_no_leaks(stack)


def test_the_cache_is_on_without_a_flag(stack_pool: StackPool) -> None:
    """A stack no flag gives a prefix cache has one, of the size its environment says (the tests'
    services get ``PDSERVE_PREFIX_CACHE_TOKENS``; the default size is checked in-process below)."""
    metrics = scrape(stack_pool.get(MODEL).prefills[0].metrics)
    assert metrics["pdserve_prefill_prefix_cache_capacity_tokens"] == 65536


def test_no_prefix_cache_turns_it_off(cache_dir: Path) -> None:
    from prometheus_client import CollectorRegistry

    m = eager_engine_model(MODEL, cache_dir)
    metrics = PrefillMetrics(CollectorRegistry())
    for config in (PrefillConfig(no_prefix_cache=True), PrefillConfig(prefix_cache_tokens=0)):
        assert build_prefix_cache(config, m, metrics) is None
    cache = build_prefix_cache(PrefillConfig(prefix_block_size=4), m, metrics)
    assert cache is not None and cache.block_size == 4
    memory = host_memory_bytes()
    assert cache.capacity_tokens == min(4 << 30, memory // 16) // m.kv_layout.bytes_per_token() // 4 * 4
