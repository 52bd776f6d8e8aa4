"""Attention of a decode step whose rows have contexts of very different lengths.

A decode step attends every row over the first ``length`` positions of its batch context, the
longest row's context, the positions past a shorter row's own being masked: one long row among
short ones makes every row read as many positions as the long one. Decode attention is memory-bound
(each row's keys and values are read once per step), so that padding is time: on the 2-core CPU
machine, one layer's attention of 17 rows of 130 positions and one of 1032 took 6.9 ms padded
against 2.6 ms split as below (the reference model of ``shared/PEERS.md``; the mixed workload, where
a 1024-token prompt decodes next to short streams, runs such steps most of the time).

``split_rows`` decides from the rows' lengths whether a step's rows split, and how: the ``k``
longest rows (a minority) are taken apart when that reads markedly fewer positions. A decode keeps
such rows' KV in a batch context of their own (``decode_service.batch_tiers``), so that neither the
memory nor the reads of the short rows are padded to the long rows' length. The short rows come
first in the step and attend over their own context in one call, the long rows over theirs in a
second call. Results equal the padded attention to float rounding: every row attends to exactly its
own positions either way.

Under torch.compile the split attention is part of the step's graph where both calls run the
decode-attention operator (``decode_attention.applies``: a CPU, float32, the operator built). Where
either would run sdpa it runs eagerly, a graph break around each layer's attention of such a step
(inductor's lowering of the CPU flash kernel fails on the tiers' symbolic strides once grouped-query
heads are repeated); the rest of the step stays compiled. The breaks cost a step of the reference
model on one CPU core about 2 ms (16 short rows and a long one: 7.8-8.4 ms with them, 6.0 ms in one
graph; 16 short rows alone 4.8-5.3 ms).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pdserve.model.decode_attention import applies, attention_forward

# A split must read at most this share of the positions the padded attention reads...
MAX_SHARE = 0.7
# ... and save at least this many row-positions (below, the second call costs more than it saves).
MIN_SAVED = 1024
# Taking a row apart costs its copy into the other batch context when the split changes, and the
# second call's overhead: it counts as this many times the longest length per long row.
SPLIT_COST = 2


class LongRows(Protocol):
    """One layer's keys and values of a step's long rows ``[rows, kv heads, length, width]``, set by
    the layer's cache update before its attention runs."""

    long_keys: torch.Tensor | None
    long_values: torch.Tensor | None


@dataclass(frozen=True)
class RaggedRows:
    """A decode step's long rows, attended apart from the short ones, whose keys and values the cache
    layers return. ``short_mask`` ``[short rows, 1, 1, short length]`` and ``long_mask`` ``[long rows,
    1, 1, long length]``: each row's positions; ``short_rows`` and ``long_rows``: their indices in the
    step (the short ones first); ``layers``: per layer, the long rows' keys and values."""

    short_mask: torch.Tensor
    long_mask: torch.Tensor
    short_rows: torch.Tensor
    long_rows: torch.Tensor
    layers: Sequence[LongRows]


def split_rows(lengths: Sequence[int]) -> tuple[int, list[int]] | None:
    """The split of a step whose rows attend over ``lengths`` positions each: the positions the short
    rows attend over and the long rows' indices; None when the padded attention is as cheap."""
    rows = len(lengths)
    order = sorted(range(rows), key=lambda i: lengths[i], reverse=True)
    longest = lengths[order[0]] if rows else 0
    padded = rows * longest
    best: tuple[int, int] | None = None  # (cost, k)
    for k in range(1, rows // 2 + 1):
        cost = (rows - k) * lengths[order[k]] + (1 + SPLIT_COST) * k * longest
        if best is None or cost < best[0]:
            best = (cost, k)
    if best is None or best[0] > MAX_SHARE * padded or padded - best[0] < MIN_SAVED:
        return None
    k = best[1]
    return lengths[order[k]], sorted(order[:k])


def ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ragged: RaggedRows,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention (``decode_attention.attention_forward``) of ``query`` ``[rows, heads, 1,
    width]``: its first rows over ``key``/``value`` ``[short rows, kv heads, length, width]``, the
    others over ``ragged``'s long rows. Returns ``[rows, 1, heads, width]`` as transformers'
    attention functions do."""
    long = ragged.layers[int(getattr(module, "layer_idx", 0))]
    long_keys, long_values = long.long_keys, long.long_values
    if long_keys is None or long_values is None:
        raise RuntimeError("the layer's cache update gave no long rows")
    short = (query.index_select(0, ragged.short_rows), key, value, ragged.short_mask)
    long_rows = (query.index_select(0, ragged.long_rows), long_keys, long_values, ragged.long_mask)
    split = _split if applies(*short) and applies(*long_rows) else _split_eagerly
    return split(module, short, long_rows, **kwargs), None


def _split(
    module: torch.nn.Module,
    short: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    long: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    **kwargs: Any,
) -> torch.Tensor:
    """The short rows' attention then the long rows', each given as (query, keys, values, mask)."""
    return torch.cat(
        [attention_forward(module, *short, **kwargs), attention_forward(module, *long, **kwargs)]
    )


_split_eagerly = torch.compiler.disable(_split)
