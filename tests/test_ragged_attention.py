"""Decode steps whose rows have very different lengths attend to the few long rows apart
(``pdserve.model.ragged_attention``, ``decode_service.batch_tiers``): the split is taken only where
it reads markedly fewer positions, the attention equals sdpa over the padded context to float
rounding, the tiers hold each row once with its KV, and the engine's greedy tokens equal
``model.generate`` with the split taken."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry
from transformers import DynamicCache

from decode_service.engine import RAGGED_WARM_UP, DecodeEngine
from decode_service.kv_pool import KvPool
from decode_service.metrics import DecodeMetrics
from pdserve.model import decode_attention
from pdserve.model.ragged_attention import MIN_SAVED, SPLIT_COST, RaggedRows, ragged_attention, split_rows
from pdserve.model.shared_prefix_attention import enable_ragged_attention
from tests.cpu_kernels import require_decode_kernel
from tests.decode_batch import decode_as_one_batch
from tests.devices import ON_CPU_AND_CUDA
from tests.engine_models import eager_engine_model
from tests.test_equivalence import reference_tokens


@pytest.fixture(scope="module")
def decode_kernel(cache_dir: Path) -> None:
    require_decode_kernel(cache_dir)


def test_one_long_row_among_short_ones_is_taken_apart() -> None:
    lengths = [130] * 16 + [1032]
    assert split_rows(lengths) == (130, [16])
    assert split_rows([1032] + [130] * 16) == (130, [0])


def test_the_k_longest_rows_are_taken_apart_when_that_reads_least() -> None:
    lengths = [40, 900, 35, 880, 50, 45, 30, 41, 33, 38, 44, 39]
    short, long_rows = split_rows(lengths) or (0, [])
    assert long_rows == [1, 3] and short == 50
    rows, longest = len(lengths), max(lengths)
    assert (rows - 2) * short + (1 + SPLIT_COST) * 2 * longest < rows * longest


@pytest.mark.parametrize(
    "lengths",
    [
        [],
        [500],
        [130] * 17,  # equal lengths: nothing to save
        [100, 120, 110, 130, 90],  # close lengths
        [64, 64, 64, 64, 1000, 990, 980, 970],  # long rows are not a minority
        [2, 3, 4, 40],  # saves fewer than MIN_SAVED positions
    ],
)
def test_no_split_where_the_padded_attention_is_as_cheap(lengths: list[int]) -> None:
    assert split_rows(lengths) is None


def test_the_saving_bound_is_what_the_split_saves() -> None:
    short = [2, 3, 4, 5, 6, 7, 8]
    rows = len(short) + 1
    # padded: rows * long; split: (rows - 1) * 8 + (1 + SPLIT_COST) * long.
    long = -(-(MIN_SAVED + (rows - 1) * 8) // (rows - 1 - SPLIT_COST))  # the shortest that saves enough
    assert split_rows([*short, long]) == (8, [rows - 1])
    assert split_rows([*short, long - 1]) is None


class _Attention(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


Case = tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, RaggedRows, torch.Tensor]


def _ragged_case(groups: int) -> Case:
    """The attention module, query, short rows' keys and values, ``RaggedRows`` of a step of 6 short
    rows and 2 long ones, and sdpa's result over the padded context."""
    generator = torch.Generator().manual_seed(groups)
    lengths = [7, 30, 5, 9, 12, 6, 90, 85]  # the short rows first, then the long ones
    short, kv_heads, width, capacity = 6, 2, 16, 128
    rows, length = len(lengths), max(lengths)
    query = torch.randn(rows, kv_heads * groups, 1, width, generator=generator)
    # Both tiers laid out as batch contexts [rows, capacity, kv heads, width], with a spare row.
    short_k, short_v, long_k, long_v = (
        torch.randn(n, capacity, kv_heads, width, generator=generator) for n in (short + 1, short + 1, 3, 3)
    )
    allowed = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    mask = torch.zeros(rows, 1, 1, length).masked_fill(
        ~allowed[:, None, None, :], torch.finfo(torch.float32).min
    )
    short_length = max(lengths[:short])
    layer = SimpleNamespace(
        long_keys=long_k[: rows - short, :length].transpose(1, 2),
        long_values=long_v[: rows - short, :length].transpose(1, 2),
    )
    ragged = RaggedRows(
        mask[:short, ..., :short_length].clone(),
        mask[short:].clone(),
        torch.arange(short),
        torch.arange(short, rows),
        [layer],
    )
    keys = torch.cat([short_k[:short, :length], long_k[: rows - short, :length]]).transpose(1, 2)
    values = torch.cat([short_v[:short, :length], long_v[: rows - short, :length]]).transpose(1, 2)
    expected = F.scaled_dot_product_attention(
        query,
        keys.repeat_interleave(groups, 1),
        values.repeat_interleave(groups, 1),
        attn_mask=allowed[:, None, None, :],
    ).transpose(1, 2)
    return (
        _Attention(groups),
        query,
        short_k[:short, :short_length].transpose(1, 2),
        short_v[:short, :short_length].transpose(1, 2),
        ragged,
        expected,
    )


def _attend(
    module: torch.nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ragged: RaggedRows
) -> torch.Tensor:
    out, _ = ragged_attention(module, query, keys, values, ragged, scaling=query.shape[-1] ** -0.5)
    return out


@pytest.mark.parametrize("groups", [1, 2])
def test_ragged_attention_equals_sdpa_over_the_padded_context(groups: int) -> None:
    module, query, keys, values, ragged, expected = _ragged_case(groups)
    got = _attend(module, query, keys, values, ragged)
    assert got.shape == expected.shape == (len(query), 1, query.shape[1], query.shape[-1])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("groups", [1, 2])
def test_compiled_steps_run_the_split_in_their_graph_where_the_operator_applies(
    decode_kernel: None, groups: int
) -> None:
    module, query, keys, values, ragged, expected = _ragged_case(groups)
    # fullgraph: dynamo raises at a graph break instead of running the split eagerly.
    compiled = torch.compile(_attend, fullgraph=True, backend="eager", dynamic=True)
    torch.testing.assert_close(compiled(module, query, keys, values, ragged), expected, rtol=1e-5, atol=1e-6)


def test_the_split_runs_eagerly_under_compile_where_sdpa_runs_it(
    decode_kernel: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    module, query, keys, values, ragged, expected = _ragged_case(2)
    monkeypatch.setattr(decode_attention._Kernel, "loaded", False)  # as with no C++ compiler
    explained = torch._dynamo.explain(_attend)(module, query, keys, values, ragged)
    assert any("torch.compiler.disable" in str(reason.reason) for reason in explained.break_reasons)
    compiled = torch.compile(_attend, backend="eager", dynamic=True)
    torch.testing.assert_close(compiled(module, query, keys, values, ragged), expected, rtol=1e-5, atol=1e-6)


def _engine_tokens(
    m: Any, prompts: list[list[int]], ragged: bool, max_tokens: int
) -> tuple[list[list[int]], float]:
    """Each prompt's greedy tokens from a decode engine given its prompt's KV, all rows in one batch,
    and the engine's ragged steps."""
    metrics = DecodeMetrics(CollectorRegistry())
    pool = KvPool(m.kv_layout, 256, 16, m.device)
    engine = DecodeEngine(m, metrics, 16, pool, ragged=ragged)
    prefilled = []
    for prompt in prompts:
        cache = DynamicCache(config=m.model.config)
        with torch.no_grad():
            logits = m.model(
                input_ids=torch.tensor([prompt], device=m.device), cache=cache, use_cache=True
            ).logits
        prefilled.append(
            (int(logits[0, -1].argmax()), [(layer.keys[0], layer.values[0]) for layer in cache.layers])
        )
    results = decode_as_one_batch(engine, pool, prefilled, max_tokens)
    return results, metrics.ragged_steps._value.get()


@ON_CPU_AND_CUDA
def test_decode_of_rows_of_very_different_lengths_equals_generate(cache_dir: Path, device: str) -> None:
    m = eager_engine_model("tiny-llama", cache_dir, device)
    assert enable_ragged_attention(m.model, "decode")
    generator = torch.Generator().manual_seed(5)
    lengths = (3, 9, 600, 5, 12, 7, 580, 4, 6, 8, 10, 11)
    prompts = [torch.randint(3, m.limits.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    got, ragged_steps = _engine_tokens(m, prompts, ragged=True, max_tokens=5)
    assert ragged_steps >= 4, "the steps did not take the long rows apart"
    assert got == [reference_tokens(m.model, prompt, 5) for prompt in prompts]
    plain, plain_steps = _engine_tokens(m, prompts, ragged=False, max_tokens=5)
    assert plain == got and plain_steps == 0


def test_the_warm_up_batches_split_with_one_and_two_long_rows() -> None:
    for short, long in RAGGED_WARM_UP:
        split = split_rows([n + 1 for n in (*short, *long)])
        assert split is not None and len(split[1]) == len(long)
