"""A compiled prefill forward's shape classes: every batch of two rows or more, padded or not, of one
new token a row or more, as many rows as the model has KV heads or not, runs one compiled graph (each
class is a compilation of tens of seconds in a cold start). Compiled with dynamo's eager backend:
the same guards and graphs as inductor's, none of its code generation."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from pdserve.model.compiled_forward import CompiledForward
from pdserve.model.engine_model import EngineModel
from prefill_service.prompt_forward import run_forward
from tests.engine_models import eager_engine_model


def traced(m: EngineModel) -> EngineModel:
    """``m`` with its forwards compiled as ``compile_model`` compiles them, but by dynamo's eager backend."""
    compiled = torch.compile(m.model, dynamic=True, backend="eager")
    return dataclasses.replace(m, forward_module=CompiledForward(m.model, compiled))


def frames() -> int:
    return int(counters["frames"]["ok"])


@pytest.fixture
def fresh_dynamo() -> None:
    torch._dynamo.reset()
    counters.clear()


@pytest.mark.usefixtures("fresh_dynamo")
def test_batches_of_any_size_and_length_share_one_class(cache_dir: Path) -> None:
    m = eager_engine_model("tiny-llama", cache_dir)
    assert m.model.config.num_key_value_heads == 2  # a batch of 2 rows is as many rows as KV heads
    compiled = traced(m)
    generator = torch.Generator().manual_seed(11)
    first = frames()
    for lengths in ((9, 5), (6, 14, 3), (1, 1), (4, 4), (1, 1, 1, 1, 1), (2, 7)):
        chunks = [torch.randint(3, m.limits.vocab_size, (n,), generator=generator).tolist() for n in lengths]
        out = run_forward(compiled, None, chunks)
        want = run_forward(m, None, chunks)
        torch.testing.assert_close(out.logits, want.logits)
        for row in range(len(chunks)):
            for (k, v), (wk, wv) in zip(out.row_kv(row), want.row_kv(row), strict=True):
                torch.testing.assert_close(k, wk)
                torch.testing.assert_close(v, wv)
        # Each row's logits are its lone prompt's: the padding changed nothing.
        for row, chunk in enumerate(chunks):
            torch.testing.assert_close(
                out.logits[row], run_forward(m, None, [chunk]).logits[0], rtol=1e-4, atol=1e-5
            )
    assert frames() - first == 1


@pytest.mark.usefixtures("fresh_dynamo")
def test_rows_over_one_past_share_one_class(cache_dir: Path) -> None:
    m = eager_engine_model("tiny-llama", cache_dir)
    compiled = traced(m)
    generator = torch.Generator().manual_seed(12)

    def past(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return run_forward(m, None, [torch.randint(3, 100, (n,), generator=generator).tolist()]).row_kv(0)

    first = frames()
    for past_len, lengths in ((16, (3, 6)), (32, (1, 1)), (16, (5, 5, 2))):
        pasts = [[(k.clone(), v.clone()) for k, v in past(past_len)] for _ in lengths]
        chunks = [torch.randint(3, m.limits.vocab_size, (n,), generator=generator).tolist() for n in lengths]
        torch.testing.assert_close(
            run_forward(compiled, pasts, chunks).logits, run_forward(m, pasts, chunks).logits
        )
    assert frames() - first == 1


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_class_is_traced_once(cache_dir: Path) -> None:
    """The model's float constants (norm epsilon, attention and rotary scaling) are compiled as the
    constants they are: taken for inputs, they failed AOTAutograd's scalar pass, which restarted
    dynamo's analysis of every class (each traced twice, the first trace's graph never cached: half
    of a warm start). Compiled by the backend that runs AOTAutograd without code generation."""
    m = eager_engine_model("tiny-llama", cache_dir)
    compiled = torch.compile(m.model, dynamic=True, backend="aot_eager")
    forward = dataclasses.replace(m, forward_module=CompiledForward(m.model, compiled))
    chunks = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    torch.testing.assert_close(run_forward(forward, None, chunks).logits, run_forward(m, None, chunks).logits)
    assert frames() == 1
    assert counters["aot_autograd"]["total"] == 1
