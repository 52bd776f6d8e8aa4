"""Decode steps whose rows share a KV prefix attend to it once for all rows
(``pdserve.model.shared_prefix_attention``): the attention equals sdpa over the whole context to
float rounding, the batch context finds exactly the positions a row shares, and the engine's
greedy tokens equal ``model.generate`` with the shared path taken."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry
from transformers import DynamicCache

from decode_service.engine import DecodeEngine
from decode_service.kv_pool import KvPool
from decode_service.metrics import DecodeMetrics
from decode_service.sequence import DecodeSequence, Emission
from decode_service.step_cache import MIN_SHARED_TOKENS, BatchContext
from pdserve.core.sampling import SamplingParams
from pdserve.kv.layout import KvLayout
from pdserve.model import decode_attention
from pdserve.model.shared_prefix_attention import attend, use_shared_prefix_attention
from tests.cpu_kernels import require_decode_kernel
from tests.decode_batch import decode_as_one_batch
from tests.devices import ON_CPU_AND_CUDA
from tests.engine_models import eager_engine_model
from tests.test_equivalence import reference_tokens


@pytest.mark.parametrize(("groups", "queries", "own"), [(1, 1, 33), (2, 1, 5), (1, 7, 7), (3, 4, 9)])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("cpu_kernel", [True, False], ids=["decode-kernel", "sdpa"])
def test_attention_over_a_shared_prefix_equals_sdpa_over_the_whole_context(
    groups: int,
    queries: int,
    own: int,
    kind: str,
    cpu_kernel: bool,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One query per row takes the CPU decode attention for the rows' own positions, or sdpa."""
    if cpu_kernel:
        require_decode_kernel(cache_dir)
    else:
        monkeypatch.setattr(decode_attention._Kernel, "loaded", False)
    generator = torch.Generator().manual_seed(groups * 100 + queries * 10 + own)
    rows, kv_heads, prefix, width = 5, 2, 40, 16
    heads = kv_heads * groups

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    query, prefix_k, prefix_v = (
        randn(rows, heads, queries, width),
        randn(kv_heads, prefix, width),
        randn(kv_heads, prefix, 8),
    )
    keys, values = randn(rows, kv_heads, own, width), randn(rows, kv_heads, own, 8)
    # Row r sees its last own_seen[r] own positions, causally for several queries.
    own_seen = torch.randint(queries, own + 1, (rows,), generator=generator)
    position = torch.arange(own)[None, None, :]
    query_at = (own - queries + torch.arange(queries))[None, :, None]
    allowed_own = (position <= query_at) & (position >= own - own_seen[:, None, None])
    allowed = torch.cat([torch.ones(rows, queries, prefix, dtype=torch.bool), allowed_own], -1)[:, None]
    whole_k = torch.cat([prefix_k[None].expand(rows, -1, -1, -1), keys], 2).repeat_interleave(groups, 1)
    whole_v = torch.cat([prefix_v[None].expand(rows, -1, -1, -1), values], 2).repeat_interleave(groups, 1)
    expected = F.scaled_dot_product_attention(query, whole_k, whole_v, attn_mask=allowed)
    mask = (
        allowed
        if kind == "bool"
        else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    )
    got = attend(query, prefix_k, prefix_v, keys, values, mask)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    if queries > 1 and bool((own_seen == own).all()):
        torch.testing.assert_close(
            attend(query, prefix_k, prefix_v, keys, values, None), expected, rtol=1e-5, atol=1e-6
        )


def test_causal_without_a_mask() -> None:
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, 2, 6, 8, generator=generator)
    prefix_k, prefix_v = (
        torch.randn(2, 10, 8, generator=generator),
        torch.randn(2, 10, 8, generator=generator),
    )
    keys, values = torch.randn(2, 2, 6, 8, generator=generator), torch.randn(2, 2, 6, 8, generator=generator)
    allowed = torch.cat([torch.ones(6, 10, dtype=torch.bool), torch.ones(6, 6, dtype=torch.bool).tril()], 1)
    whole_k = torch.cat([prefix_k[None].expand(2, -1, -1, -1), keys], 2)
    whole_v = torch.cat([prefix_v[None].expand(2, -1, -1, -1), values], 2)
    expected = F.scaled_dot_product_attention(query, whole_k, whole_v, attn_mask=allowed)
    torch.testing.assert_close(
        attend(query, prefix_k, prefix_v, keys, values, None), expected, rtol=1e-5, atol=1e-6
    )


def _context_with(rows: list[torch.Tensor]) -> BatchContext:
    """A batch context holding rows whose KV (every layer, keys and values) is ``rows[i]`` ``[T, 1, 2]``."""
    layout = KvLayout(keys=((1, 2), (1, 2)), values=((1, 2), (1, 2)), dtype=torch.float32)
    pool = KvPool(layout, 64, 4, torch.device("cpu"))
    context = BatchContext(pool, 8, share=True)
    blocks = []
    for kv in rows:
        owned = pool.allocate(kv.shape[0])
        pool.write(owned, [(kv.transpose(0, 1), kv.transpose(0, 1))] * 2)
        blocks.append(owned)
    context.sync(list(range(len(rows))), blocks, [kv.shape[0] for kv in rows])
    return context


def test_the_batch_context_measures_what_each_row_shares_bit_for_bit() -> None:
    base = torch.randn(40, 1, 2)
    other = base.clone()
    other[30, 0, 1] += 1e-6  # differs from position 30 on
    short = base[:24].clone()
    context = _context_with([base, other, short])
    assert context.shared_lengths == [40, 30, 24]
    assert context.shared_length() == 23  # the shortest row keeps its last cached position
    assert torch.equal(context.prefix.keys[0][:, :23], base[:23].transpose(0, 1))
    # A row that shares fewer than MIN_SHARED_TOKENS positions turns the shared attention off.
    early = base.clone()
    early[MIN_SHARED_TOKENS - 2] += 1.0
    assert _context_with([base, early]).shared_length() == 0
    assert _context_with([base]).shared_length() == 39  # one row: all but its last cached position
    assert _context_with([base[:MIN_SHARED_TOKENS]]).shared_length() == 0


def test_when_no_live_row_shares_the_prefix_the_next_row_becomes_it() -> None:
    layout = KvLayout(keys=((1, 2),), values=((1, 2),), dtype=torch.float32)
    pool = KvPool(layout, 64, 4, torch.device("cpu"))
    context = BatchContext(pool, 8, share=True)
    a, b = torch.randn(20, 1, 2), torch.randn(20, 1, 2)
    blocks = {}
    for name, kv in (("a", a), ("b", b), ("b2", b), ("c", b)):
        blocks[name] = pool.allocate(20)
        pool.write(blocks[name], [(kv.transpose(0, 1), kv.transpose(0, 1))])
    context.sync([0], [blocks["a"]], [20])
    context.sync([1], [blocks["b"]], [20])  # a left: b becomes the shared prefix
    context.sync([1, 2], [blocks["b"], blocks["b2"]], [20, 20])
    assert context.shared_lengths == [20, 20] and context.shared_length() == 19
    context.clear()
    context.sync([3, 4], [blocks["a"], blocks["c"]], [20, 20])  # joining together: a becomes it
    assert context.shared_lengths == [20, 0] and context.shared_length() == 0


def _prefilled(m: Any, prompts: list[list[int]], prefix: list[int]) -> list[tuple[int, Any]]:
    """Each prompt's first token and KV; the first ``len(prefix)`` positions of those that begin with
    ``prefix`` come from one forward (bit for bit the same for each of them)."""
    with torch.no_grad():
        prefix_cache = DynamicCache(config=m.model.config)
        m.model(input_ids=torch.tensor([prefix], device=m.device), cache=prefix_cache, use_cache=True)
    prefix_kv = [(layer.keys, layer.values) for layer in prefix_cache.layers]
    prefilled = []
    for prompt in prompts:
        cache = DynamicCache(config=m.model.config)
        start = len(prefix) if prompt[: len(prefix)] == prefix else 0
        if start:
            for layer, (k, v) in enumerate(prefix_kv):
                cache.update(k.clone(), v.clone(), layer)
        with torch.no_grad():
            logits = m.model(
                input_ids=torch.tensor([prompt[start:]], device=m.device),
                cache=cache,
                use_cache=True,
                position_ids=torch.arange(start, len(prompt), device=m.device)[None],
            ).logits
        kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
        prefilled.append((int(logits[0, -1].argmax()), kv))
    return prefilled


def _engine_tokens(
    m: Any, prompts: list[list[int]], prefix_len: int, shared: bool, max_tokens: int
) -> tuple[list[list[int]], float]:
    """Each prompt's greedy tokens from a decode engine given KV whose first ``prefix_len`` positions
    come from one forward (bit for bit the same for every prompt), and the engine's shared-prefix steps."""
    metrics = DecodeMetrics(CollectorRegistry())
    pool = KvPool(m.kv_layout, 256, 16, m.device)
    engine = DecodeEngine(m, metrics, 8, pool, shared_prefix=shared)
    prefilled = _prefilled(m, prompts, prompts[0][:prefix_len])
    results = decode_as_one_batch(engine, pool, prefilled, max_tokens)
    return results, metrics.shared_prefix_steps._value.get()


def test_decode_over_a_shared_prefix_equals_generate(cache_dir: Path) -> None:
    m = eager_engine_model("tiny-llama", cache_dir)
    assert use_shared_prefix_attention(m.model) is None
    generator = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, m.limits.vocab_size, (37,), generator=generator).tolist()
    prompts = [
        prefix + torch.randint(3, m.limits.vocab_size, (n,), generator=generator).tolist()
        for n in (1, 5, 9, 2)
    ]
    got, shared_steps = _engine_tokens(m, prompts, len(prefix), shared=True, max_tokens=6)
    assert shared_steps >= 4, "the steps did not attend to the shared prefix once"
    assert got == [reference_tokens(m.model, prompt, 6) for prompt in prompts]
    plain, plain_steps = _engine_tokens(m, prompts, len(prefix), shared=False, max_tokens=6)
    assert plain == got and plain_steps == 0


@ON_CPU_AND_CUDA
def test_requests_joining_and_leaving_over_a_shared_prefix_equal_generate(
    cache_dir: Path, device: str
) -> None:
    # Rows join one by one (the first alone leaves all but one position to the prefix), one that
    # shares nothing joins mid-run (every row takes the prefix back) and leaves, rows leave early.
    m = eager_engine_model("tiny-llama", cache_dir, device)
    assert use_shared_prefix_attention(m.model) is None
    generator = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, m.limits.vocab_size, (n,), generator=generator).tolist()

    prefix = tokens(41)
    prompts = [prefix + tokens(n) for n in (3, 7, 1)] + [tokens(30), prefix + tokens(12), prefix[:20]]
    max_tokens = [14, 4, 12, 5, 9, 8]
    prefilled = _prefilled(m, prompts, prefix)
    metrics = DecodeMetrics(CollectorRegistry())
    pool = KvPool(m.kv_layout, 256, 16, m.device)
    engine = DecodeEngine(m, metrics, 8, pool, shared_prefix=True)
    results: list[list[int]] = [[first] for first, _ in prefilled]
    progress = [threading.Event() for _ in prompts]  # set at each request's third token
    done = [threading.Event() for _ in prompts]

    def submit(i: int) -> None:
        def emit(emission: Emission) -> None:
            results[i].extend(emission.token_ids)
            if len(results[i]) >= 3:
                progress[i].set()
            if emission.finish_reason is not None or emission.error is not None:
                progress[i].set()
                done[i].set()

        params = SamplingParams(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
        engine.submit(DecodeSequence(f"r{i}", prefilled[i][1], prefilled[i][0], params, emit))

    engine.start()
    try:
        for i in range(len(prompts)):
            submit(i)
            assert progress[i].wait(60)
        assert all(event.wait(60) for event in done)
    finally:
        engine.stop()
    assert results == [reference_tokens(m.model, p, n) for p, n in zip(prompts, max_tokens, strict=True)]
    assert metrics.shared_prefix_steps._value.get() >= 10
    assert pool.num_used_blocks == 0
