"""The prefill engine with its prefix cache and chunked prefill: the first token and the whole KV it
parks are those of a prompt run alone (greedy continuations from that KV equal ``model.generate``),
on every preset, for prefixes ending mid-block, fully cached prompts, batches of rows with different
cached lengths, resumed requests and evictions under pressure; and a short prompt behind a long one
gets its first token between the long one's chunks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from pdserve.core.sampling import SamplingParams
from pdserve.kv.layout import unpack
from pdserve.model.engine_model import EngineModel
from pdserve.model.shared_prefix_attention import use_shared_prefix_attention
from prefill_service.engine import PrefillEngine, PrefillResult
from prefill_service.prefix_cache import PrefixCache, reuse_problem
from tests.engine_models import eager_engine_model
from tests.test_equivalence import reference_tokens

PRESETS = ["tiny-llama", "tiny-moe", "tiny-mla-moe", "tiny-deepseek-moe"]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def models(cache_dir: Path) -> Iterator[dict[str, EngineModel]]:
    loaded: dict[str, EngineModel] = {}

    def get(name: str) -> EngineModel:
        if name not in loaded:
            loaded[name] = eager_engine_model(name, cache_dir)
        return loaded[name]

    yield _Lazy(get)  # type: ignore[misc]


class _Lazy(dict[str, EngineModel]):
    def __init__(self, get: Any) -> None:
        super().__init__()
        self._get = get

    def __missing__(self, name: str) -> EngineModel:
        model: EngineModel = self._get(name)
        return model


def continuation(m: EngineModel, prompt: Sequence[int], result: PrefillResult, n: int) -> list[int]:
    """The first token, then greedy tokens decoded over the KV the prefill packed."""
    assert result.kv is not None and result.num_tokens == len(prompt)
    cache = DynamicCache(config=m.model.config)
    for i, (k, v) in enumerate(unpack(result.kv.tensor, m.kv_layout, len(prompt))):
        cache.update(k[None].clone(), v[None].clone(), i)
    tokens = [result.first_token_id]
    with torch.no_grad():
        for _ in range(n - 1):
            out = m.model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def random_prompt(m: EngineModel, n: int, seed: int) -> list[int]:
    return torch.randint(3, m.limits.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("preset", PRESETS)
def test_prefix_cache_is_exact(models: dict[str, EngineModel], preset: str) -> None:
    m = models[preset]
    assert reuse_problem(m.model) is None
    evicted: list[int] = []
    cache = PrefixCache(
        4, 40, m.kv_layout, m.device, on_evict=evicted.append
    )  # 10 blocks: the prompts below overflow it
    engine = PrefillEngine(m, m.device, max_batch_tokens=24, prefix_cache=cache)
    base = random_prompt(m, 21, 1)
    own = random_prompt(m, 30, 2)

    async def run_all() -> list[tuple[list[int], int, PrefillResult]]:
        done = []
        for prompt, num_generated in [
            (base, 0),  # nothing cached: its 5 blocks are
            ([*base[:13], *own[:3]], 0),  # a prefix ending mid-block: 3 blocks
            (base, 0),  # fully cached but its last token: 5 blocks
            ([*base, *reference_tokens(m.model, base, 2)], 2),  # resumed
        ]:
            done.append((prompt, num_generated, await engine.run(prompt, GREEDY, num_generated)))
        together = [[*base[:8], *own[:3]], [*base[:12], *own[3:5]], own[:7], [*base[:4], *own]]
        results = await asyncio.gather(*(engine.run(p, GREEDY) for p in together))
        done += [(p, 0, r) for p, r in zip(together, results, strict=True)]
        return done

    try:
        done = asyncio.run(run_all())
        complete = asyncio.run(engine.run(base, SamplingParams(max_tokens=1, temperature=0.0)))
    finally:
        engine.close()
    assert [r.cached_tokens for _, _, r in done] == [0, 12, 20, 20, 8, 12, 0, 4]
    for prompt, num_generated, result in done:
        expected = reference_tokens(m.model, prompt, 4 - num_generated)
        assert continuation(m, prompt, result, 4 - num_generated) == expected, (prompt, result.cached_tokens)
    assert complete.kv is None and complete.finish_reason == "length"
    assert complete.first_token_id == reference_tokens(m.model, base, 1)[0]
    assert evicted and cache.num_tokens <= 40 and cache.num_referenced_blocks == 0
    assert engine.num_waiting == 0 and engine.num_running == 0


def test_kv_with_the_cache_is_the_kv_without_it(models: dict[str, EngineModel]) -> None:
    m = models["tiny-llama"]
    prompts = [random_prompt(m, 40, 5)]
    prompts.append([*prompts[0][:33], *random_prompt(m, 5, 6)])
    plain = PrefillEngine(m, m.device)
    cached = PrefillEngine(m, m.device, prefix_cache=PrefixCache(16, 1024, m.kv_layout, m.device))

    async def run(engine: PrefillEngine) -> list[PrefillResult]:
        return [await engine.run(p, GREEDY) for p in prompts]

    try:
        without, with_cache = asyncio.run(run(plain)), asyncio.run(run(cached))
    finally:
        plain.close()
        cached.close()
    assert [r.cached_tokens for r in with_cache] == [0, 32]
    for a, b in zip(without, with_cache, strict=True):
        assert a.first_token_id == b.first_token_id and a.kv is not None and b.kv is not None
        assert torch.allclose(a.kv.tensor.view(torch.float32), b.kv.tensor.view(torch.float32), atol=1e-5)


def test_rows_over_one_cached_prefix_read_it_once_and_stay_exact(models: dict[str, EngineModel]) -> None:
    m = models["tiny-llama"]
    assert use_shared_prefix_attention(m.model) is None  # sdpa unless a forward shares a prefix
    prefix = random_prompt(m, 37, 9)
    prompts = [[*prefix, *random_prompt(m, n, 10 + n)] for n in (1, 4, 9, 2)]
    engines = {
        shared: PrefillEngine(
            m, m.device, prefix_cache=PrefixCache(16, 1024, m.kv_layout, m.device), shared_prefix=shared
        )
        for shared in (True, False)
    }

    async def run(engine: PrefillEngine) -> list[PrefillResult]:
        await engine.run(prefix, GREEDY)  # caches its two full blocks
        return list(await asyncio.gather(*(engine.run(p, GREEDY) for p in prompts)))

    try:
        results = {shared: asyncio.run(run(engine)) for shared, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    assert engines[True].num_shared_prefix_forwards == 1 and engines[False].num_shared_prefix_forwards == 0
    for prompt, once, apart in zip(prompts, results[True], results[False], strict=True):
        assert once.cached_tokens == apart.cached_tokens == 32 and once.batch_size == 4
        assert once.kv is not None and apart.kv is not None
        torch.testing.assert_close(
            once.kv.tensor.view(torch.float32), apart.kv.tensor.view(torch.float32), atol=1e-5, rtol=1e-5
        )
        assert continuation(m, prompt, once, 4) == reference_tokens(m.model, prompt, 4)


def test_a_long_prompt_runs_in_chunks_and_a_short_one_between_them(models: dict[str, EngineModel]) -> None:
    m = models["tiny-llama"]
    long, short = random_prompt(m, 700, 7), random_prompt(m, 10, 8)
    chunked = PrefillEngine(m, m.device, max_batch_tokens=64)
    whole = PrefillEngine(m, m.device, max_batch_tokens=1024)

    async def race() -> tuple[list[str], PrefillResult, PrefillResult]:
        order: list[str] = []

        async def one(name: str, prompt: list[int]) -> PrefillResult:
            result = await chunked.run(prompt, GREEDY)
            order.append(name)
            return result

        first = asyncio.ensure_future(one("long", long))
        await asyncio.sleep(0.01)  # the long prompt is in its chunks
        second = await one("short", short)
        return order, await first, second

    try:
        order, long_result, short_result = asyncio.run(race())
        unchunked = asyncio.run(whole.run(long, GREEDY))
    finally:
        chunked.close()
        whole.close()
    assert order == ["short", "long"], "the short prompt waited for the whole long one"
    assert short_result.forward_seconds < long_result.forward_seconds
    assert continuation(m, long, long_result, 4) == reference_tokens(m.model, long, 4)
    assert continuation(m, short, short_result, 4) == reference_tokens(m.model, short, 4)
    assert long_result.first_token_id == unchunked.first_token_id
    assert long_result.kv is not None and unchunked.kv is not None
    assert torch.allclose(
        long_result.kv.tensor.view(torch.float32), unchunked.kv.tensor.view(torch.float32), atol=1e-4
    )


def test_a_prompt_chunked_into_a_full_cache_lies_in_consecutive_blocks(
    models: dict[str, EngineModel],
) -> None:
    """Once the cache is full and its least recently used blocks are scattered, a prompt run in
    chunks still takes consecutive slots: a later prompt over it reads its KV in place (no gather)
    and stays exact."""
    m = models["tiny-llama"]
    cache = PrefixCache(4, 96, m.kv_layout, m.device)  # 24 blocks
    engine = PrefillEngine(m, m.device, max_batch_tokens=16, prefix_cache=cache)
    fillers = [random_prompt(m, 9, 40 + i) for i in range(12)]  # two blocks each: the cache is full
    long = random_prompt(m, 41, 60)  # ten blocks, offered chunk by chunk
    again = [*long[:40], *random_prompt(m, 3, 61)]

    async def run_all() -> tuple[PrefillResult, PrefillResult]:
        for prompt in fillers:
            await engine.run(prompt, GREEDY)
        for prompt in fillers[1::2]:
            await engine.run(prompt, GREEDY)  # every other filler used again: the oldest are apart
        await engine.run(long, GREEDY)
        match = cache.lookup(cache.hashes(again), len(again))
        try:
            keys, values = cache.kv(match)[0]
            assert match.num_tokens == 40 and keys._is_view() and values._is_view()
        finally:
            cache.release(match)
        return await engine.run(long, GREEDY), await engine.run(again, GREEDY)

    try:
        first, second = asyncio.run(run_all())
    finally:
        engine.close()
    assert first.cached_tokens == second.cached_tokens == 40
    assert continuation(m, again, second, 4) == reference_tokens(m.model, again, 4)
    assert cache.num_referenced_blocks == 0 and cache.num_gathered == 0
