"""One prefill forward: new tokens of several prompts over the KV each already has (of one length).

Every row brings ``past`` tokens of KV (none, a cached prefix, or the chunks it ran before) and its
new tokens, left-padded to the longest: row r's sequence is ``[past | padding | new]``. The padding is
masked and the position ids continue from ``past`` for every row, so each row's result is the one
of its tokens alone; with no past this is the batched forward of whole prompts. ``logits_to_keep=1``:
the logits are those of each row's last token.

A row's KV after the forward is its past followed by its new tokens (``row_kv``, ``spans``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from pdserve.model.engine_model import EngineModel
from prefill_service.prefix_cache import LayerKv

# Per layer, the keys and values of a batch: ``[rows, heads, tokens, width]`` each.
BatchKv = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [rows, vocab]: each row's last position
    layers: BatchKv  # the cache after the forward: [rows, heads, past + longest new, width]
    past: int
    padding: list[int]  # left padding of each row's new tokens
    kept: torch.Tensor | None = None  # [rows, keep, vocab]: the last ``keep`` positions, when keep > 1

    def spans(self, row: int) -> list[tuple[int, int]]:
        """Where row ``row``'s tokens lie in ``layers``: ``(start, count)``, in token order."""
        longest = self.layers[0][0].shape[2] - self.past
        new = longest - self.padding[row]
        found = [(0, self.past), (self.past + self.padding[row], new)]
        return [(start, count) for start, count in found if count > 0]

    def row_kv(self, row: int) -> LayerKv:
        """Row ``row``'s KV, per layer ``[heads, tokens, width]`` (views when it is not padded)."""
        spans = self.spans(row)
        if len(spans) == 1:
            start, count = spans[0]
            return [
                (k[row, :, start : start + count], v[row, :, start : start + count]) for k, v in self.layers
            ]
        return [
            (
                torch.cat([k[row, :, s : s + n] for s, n in spans], dim=1),
                torch.cat([v[row, :, s : s + n] for s, n in spans], dim=1),
            )
            for k, v in self.layers
        ]


def run_forward(
    m: EngineModel, pasts: Sequence[LayerKv] | None, chunks: Sequence[Sequence[int]], keep: int = 1
) -> ForwardOutput:
    """The forward of ``chunks`` (one row each) over ``pasts`` (each row's KV so far, all of one
    length; None: no past). ``keep`` > 1: the logits of the last ``keep`` positions are kept too
    (a request's prompt logprobs)."""
    lengths = [len(c) for c in chunks]
    longest = max(lengths)
    rows = len(chunks)
    input_ids = torch.zeros((rows, longest), dtype=torch.long)
    mask = torch.zeros((rows, longest), dtype=torch.long)
    for row, chunk in enumerate(chunks):
        input_ids[row, longest - lengths[row] :] = torch.tensor(chunk)
        mask[row, longest - lengths[row] :] = 1
    cache = DynamicCache(config=m.model.config)
    past = 0
    if pasts is not None:
        past = pasts[0][0][0].shape[1]
        for i, layer in enumerate(zip(*pasts, strict=True)):
            keys = torch.stack([k for k, _ in layer]) if rows > 1 else layer[0][0][None]
            values = torch.stack([v for _, v in layer]) if rows > 1 else layer[0][1][None]
            cache.update(keys, values, i)
    kwargs: dict[str, Any] = {}
    if rows > 1:  # left padding: every row ends at the last position
        kwargs["attention_mask"] = torch.cat([torch.ones((rows, past), dtype=torch.long), mask], 1).to(
            m.device
        )
    if rows > 1 or past:
        kwargs["position_ids"] = (past + (mask.cumsum(-1) - 1).clamp(min=0)).to(m.device)
    out = m.forward(
        input_ids=input_ids.to(m.device), cache=cache, use_cache=True, logits_to_keep=keep, **kwargs
    )
    return ForwardOutput(
        logits=out.logits[:, -1],
        kept=out.logits if keep > 1 else None,
        layers=[(layer.keys, layer.values) for layer in cache.layers],
        past=past,
        padding=[longest - n for n in lengths],
    )
