"""A decode step's attention on a CPU: one query per row, its keys and values read in position order.

In a decode step every row has one query; its keys and values lie in the batch context as
``[rows, positions, kv heads, width]`` (``decode_service.step_cache``), seen by attention as the
view ``[rows, kv heads, positions, width]``. torch's CPU attention (the flash kernel sdpa takes)
walks that view head by head: for each row and head two small GEMMs (MKL's GEMV) over positions a
kilobyte apart, each pass touching a quarter of every cache line it loads. The memory is read four
times over and the hardware prefetcher sees strides: measured on the 2-core CPU machine, one
thread, 32 rows of 126 positions of the reference model (4 heads of 64), four layers whose keys
and values are not in cache: 6.0-6.4 ms, where reading those 32 MB once takes 1.8 ms. A decode
step of 32 rows spent a third of its time there (``perf``: ``mkl_blas_def_xsgemv``).

``pdserve::decode_attention`` (``decode_attention.cpp``) reads each row's keys, then its values,
position by position, every head of a position together, as they lie in memory: 2.9 ms for the
same four layers. Scores, softmax and sums are float32, as sdpa's; results equal sdpa's to float
rounding (the sums run in another order). Grouped-query heads share their key and value head.
Positions a row's mask leaves out (-inf, or the lowest float as transformers' masks have them) are
not read where the row attends to any other: their weight is exactly 0, so the result is the same
to the bit, whatever lies there. A batch context holds its rows up to the longest one's length, so
a step of rows of different lengths reads only each row's own positions: 16 rows of 64 to 184
positions (a context 185 wide), one layer of the reference model, 0.44-0.45 ms against 0.64-0.70 ms
reading every position.

The operator is C++ built with the machine's compiler when the engine loads its model (``load``,
through ``pdserve.model.cpu_kernel``: a few seconds, then cached under the cache directory),
and a forward takes it where it applies (``attend_one_query``: a CPU, float32, one query per row,
no mask or an additive one): plain and ragged decode steps, and the rows' own positions after a
shared prefix (``shared_prefix_attention``, which joins them to the prefix's part by each query's
log-sum-exp, returned too); elsewhere (no compiler, CUDA, prefill forwards) sdpa runs as before.
Compiled forwards call it as they call any operator (its shape function is registered here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pdserve.model import cpu_kernel

SOURCE = Path(__file__).with_suffix(".cpp")
OPERATOR = "pdserve::decode_attention"

_LIBRARY = torch.library.Library("pdserve", "FRAGMENT")
_LIBRARY.define(
    "decode_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale) -> (Tensor, Tensor)"
)


@torch.library.register_fake(OPERATOR, lib=_LIBRARY)
def _shape(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, heads = query.shape[0], query.shape[1]
    return query.new_empty((rows, 1, heads, value.shape[3])), query.new_empty((rows, heads))


class _Kernel:
    """Whether this process loaded the operator's CPU kernel (read by forwards as they are traced)."""

    loaded = False


def is_loaded() -> bool:
    return _Kernel.loaded


def load(cache_dir: Path) -> bool:
    """Builds the operator under ``cache_dir`` (once per source, torch and CPU) and loads it into this
    process; returns whether it is loaded. A build that fails is logged, and forwards run sdpa."""
    if is_loaded():
        return True
    if cpu_kernel.load(SOURCE, cache_dir, "decode attention kernel", "decode steps on a CPU run sdpa"):
        _Kernel.loaded = torch._C._dispatch_has_kernel_for_dispatch_key(OPERATOR, "CPU")
    return _Kernel.loaded


def applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether the operator computes the attention of ``query`` over ``key``/``value`` under ``mask``
    (as ``attend_one_query`` takes them)."""
    if query.device.type != "cpu" or query.dim() != 4 or query.shape[2] != 1 or not is_loaded():
        return False
    if (
        any(t.dtype != torch.float32 for t in (query, key, value))
        or key.stride(3) != 1
        or value.stride(3) != 1
    ):
        return False
    if mask is None:
        return True
    if mask.dtype != torch.float32 or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        return False
    return bool(mask.shape[3] >= key.shape[2] and mask.shape[0] in (1, query.shape[0]))


def attend_one_query(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The attention of one query per row, ``[rows, 1, heads, value width]``, and the log-sum-exp of
    each query's scaled scores ``[rows, heads]``, where the operator applies: ``query`` ``[rows,
    heads, 1, width]`` and ``key``/``value`` ``[rows, kv heads, positions, width]`` float32 on a CPU,
    ``mask`` None or additive float32 ``[rows or 1, 1, 1, >= positions]`` (its first ``positions``).
    None where it does not (the caller runs sdpa)."""
    if not applies(query, key, value, mask):
        return None
    positions = key.shape[2]
    if mask is not None:
        mask = mask[..., :positions].expand(query.shape[0], 1, 1, positions)
    scale = scaling if scaling is not None else query.shape[3] ** -0.5
    out, lse = torch.ops.pdserve.decode_attention(query, key, value, mask, scale)
    return out, lse


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' sdpa attention (``[rows, queries, heads, width]``), through the operator where
    it applies (``attend_one_query``)."""
    one_query = attend_one_query(query, key, value, mask, kwargs.get("scaling"))
    if one_query is not None:
        return one_query[0]
    out, _ = sdpa_attention_forward(module, query, key, value, mask, **kwargs)
    return out
