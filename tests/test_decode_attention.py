"""The CPU decode attention operator: sdpa's result for one query per row, over batch-context views."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.model import cpu_kernel, decode_attention
from pdserve.model.decode_attention import attend_one_query
from tests.cpu_kernels import require_decode_kernel


@pytest.fixture(scope="module")
def kernel(cache_dir: Path) -> None:
    require_decode_kernel(cache_dir)


def reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Eager sdpa in float64, grouped heads repeated: ``[rows, 1, heads, value width]``."""
    group = query.shape[1] // key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.double(),
        key.double().repeat_interleave(group, 1),
        value.double().repeat_interleave(group, 1),
        attn_mask=None if mask is None else mask.double(),
        scale=scale,
    )
    return out.transpose(1, 2).float()


def reference_lse(
    query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The log-sum-exp of each query's scaled, masked scores, float64: ``[rows, heads]``."""
    group = query.shape[1] // key.shape[1]
    scores = query.double() @ key.double().repeat_interleave(group, 1).transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask.double()
    return torch.logsumexp(scores, -1)[..., 0].float()


def attended(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    got = attend_one_query(query, key, value, mask, scale)
    assert got is not None
    return got[0]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    width=st.sampled_from([8, 16, 24, 64]),
    value_width=st.sampled_from([8, 32, 64]),
    positions=st.integers(1, 70),
    spare=st.integers(0, 9),
    masked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_it_equals_sdpa_over_a_batch_context_view(
    kernel: None,
    rows: int,
    kv_heads: int,
    group: int,
    width: int,
    value_width: int,
    positions: int,
    spare: int,
    masked: bool,
    seed: int,
) -> None:
    generator = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    # As a batch context holds them: [rows, capacity, kv heads, width], positions past the row's unused.
    keys = torch.randn(rows + 1, positions + spare, kv_heads, width, generator=generator)
    values = torch.randn(rows + 1, positions + spare, kv_heads, value_width, generator=generator)
    key = keys[:rows, :positions].transpose(1, 2)
    value = values[:rows, :positions].transpose(1, 2)
    query = torch.randn(rows, 1, heads, width, generator=generator).transpose(1, 2)  # as projected
    mask = None
    if masked:  # each row attends to its first positions (at least one), with spare mask columns
        lengths = torch.randint(1, positions + 1, (rows,), generator=generator)
        mask = torch.zeros(rows, 1, 1, positions + spare)
        beyond = torch.arange(positions + spare)[None, :] >= lengths[:, None]
        mask.masked_fill_(beyond[:, None, None, :], torch.finfo(torch.float32).min)
    scale = 0.3
    got = attend_one_query(query, key, value, mask, scale)
    assert got is not None
    used = None if mask is None else mask[..., :positions]
    torch.testing.assert_close(got[0], reference(query, key, value, used, scale), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], reference_lse(query, key, used, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("left_out", [float("-inf"), torch.finfo(torch.float32).min])
def test_the_positions_a_row_does_not_attend_to_are_not_read(kernel: None, left_out: float) -> None:
    """A batch context's positions past a row's length hold whatever was there: NaN and inf included."""
    generator = torch.Generator().manual_seed(7)
    rows, positions = 4, 40
    key = torch.randn(rows, 2, positions, 16, generator=generator)
    value = torch.randn(rows, 2, positions, 32, generator=generator)
    query = torch.randn(rows, 4, 1, 16, generator=generator)
    lengths = torch.tensor([1, 17, 39, 40])
    beyond = torch.arange(positions)[None, :] >= lengths[:, None]
    mask = torch.zeros(rows, 1, 1, positions).masked_fill_(beyond[:, None, None, :], left_out)
    clean_key, clean_value = key.clone(), value.clone()
    garbage = beyond[:, None, :, None]
    key.masked_fill_(garbage & (torch.arange(16) % 2 == 0), float("nan"))
    key.masked_fill_(garbage & (torch.arange(16) % 2 == 1), float("inf"))
    value.masked_fill_(garbage, float("nan"))
    got = attend_one_query(query, key, value, mask, 0.25)
    assert got is not None
    finite_mask = mask.clamp(min=torch.finfo(torch.float32).min)
    torch.testing.assert_close(
        got[0], reference(query, clean_key, clean_value, finite_mask, 0.25), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        got[1], reference_lse(query, clean_key, finite_mask, 0.25), rtol=1e-5, atol=1e-5
    )
    # Where garbage is finite, skipping it changes no bit of what reading it gave.
    assert torch.equal(got[0], attended(query, clean_key, clean_value, mask, 0.25))


def test_a_row_its_mask_leaves_out_everywhere_weighs_its_positions_alike(kernel: None) -> None:
    """As sdpa with transformers' lowest-float masks: every score is the lowest float, so the weights
    are equal (nothing is left to skip)."""
    query, key, value = torch.randn(2, 2, 1, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = torch.zeros(2, 1, 1, 5)
    mask[1] = torch.finfo(torch.float32).min
    got = attended(query, key, value, mask, 0.5)
    torch.testing.assert_close(got[1, 0], value[1].mean(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[:1], reference(query[:1], key[:1], value[:1], mask[:1], 0.5))


def test_one_mask_row_serves_every_row(kernel: None) -> None:
    query, key, value = torch.randn(3, 2, 1, 8), torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    mask = torch.zeros(1, 1, 1, 6)
    mask[..., 4:] = torch.finfo(torch.float32).min
    got = attended(query, key, value, mask, 0.5)
    torch.testing.assert_close(got, reference(query, key, value, mask, 0.5), rtol=1e-5, atol=1e-5)


def test_the_default_scale_is_one_over_the_root_of_the_width(kernel: None) -> None:
    query, key, value = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    got = attended(query, key, value, None, None)
    torch.testing.assert_close(got, reference(query, key, value, None, 0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    [
        "two queries",
        "float64",
        "boolean mask",
        "mask shorter than the keys",
        "mask per query head",
        "width strided",
    ],
)
def test_it_leaves_other_forwards_to_sdpa(kernel: None, case: str) -> None:
    query, key, value = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    mask: torch.Tensor | None = torch.zeros(2, 1, 1, 6)
    if case == "two queries":
        query = torch.randn(2, 4, 2, 8)
    elif case == "float64":
        query, key, value = query.double(), key.double(), value.double()
    elif case == "boolean mask":
        mask = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    elif case == "mask shorter than the keys":
        mask = torch.zeros(2, 1, 1, 5)
    elif case == "mask per query head":
        mask = torch.zeros(2, 4, 1, 6)
    elif case == "mask of other rows":
        mask = torch.zeros(3, 1, 1, 6)
    else:
        key = torch.randn(2, 2, 6, 16)[..., ::2]
    assert attend_one_query(query, key, value, mask, None) is None


def test_compiled_code_calls_it_without_a_graph_break(kernel: None) -> None:
    query, key, value = torch.randn(3, 4, 1, 16), torch.randn(3, 2, 9, 16), torch.randn(3, 2, 9, 16)
    mask = torch.zeros(3, 1, 1, 9)
    mask[0, ..., 4:] = torch.finfo(torch.float32).min

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return attended(q, k, v, m, 0.25) * 2

    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    torch.testing.assert_close(
        compiled(query, key, value, mask), 2 * reference(query, key, value, mask, 0.25)
    )


def test_a_built_kernel_is_reused_and_a_missing_compiler_is_reported(
    kernel: None, cache_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    directory = cache_dir / cpu_kernel.CACHE_SUBDIR
    library = cpu_kernel.build(decode_attention.SOURCE, directory)
    built_at = library.stat().st_mtime_ns
    assert cpu_kernel.build(decode_attention.SOURCE, directory) == library
    assert library.stat().st_mtime_ns == built_at
    monkeypatch.setenv(cpu_kernel.COMPILER_ENV, "/nonexistent/c++")
    with pytest.raises(FileNotFoundError, match=r"no C\+\+ compiler"):
        cpu_kernel.build(decode_attention.SOURCE, directory)
    monkeypatch.setattr(decode_attention._Kernel, "loaded", False)
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert not decode_attention.load(cache_dir / "elsewhere")
    assert "decode steps on a CPU run sdpa" in caplog.text
    assert (
        attend_one_query(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), None, 1.0)
        is None
    )
