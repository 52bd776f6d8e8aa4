"""``static_dims``: a size marked static stays a constant of compiled code, so a size that equalled it
when the code compiled may change later without another compilation."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from pdserve.model.compiled_forward import static_dims


def attend(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return (query @ keys.transpose(-2, -1)).softmax(-1)


def frames_compiled(mark: bool) -> int:
    """Frames compiled when rows first equal the width, then differ."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(attend, backend=counter, dynamic=True)
    width = 8
    for rows in (width, 5, 11):
        query, keys = torch.randn(rows, 1, width), torch.randn(rows, 3, width)
        if mark:
            static_dims(query, -1)
            static_dims(keys, -1)
        compiled(query, keys)
    return int(counter.frame_count)


def test_equal_sizes_compiled_once_when_marked() -> None:
    # Unmarked, dynamo takes rows and width for one size while they are equal, and compiles again.
    assert frames_compiled(mark=False) > 1
    assert frames_compiled(mark=True) == 1


@pytest.mark.parametrize("dims", [(0, 2), (-3, -1)])
def test_marks_sizes_counted_from_either_end(dims: tuple[int, int]) -> None:
    tensor = static_dims(torch.zeros(2, 3, 4), *dims)
    assert tensor._dynamo_static_indices == {0, 2}  # type: ignore[attr-defined]
