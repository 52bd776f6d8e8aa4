"""One prefill forward: new tokens of several prompts over the KV each already has (of one length).

Every row brings ``past`` tokens of KV (none, a cached prefix, or the chunks it ran before) and its
new tokens, left-padded to the longest. The forward's cache is laid out once per layer as
``[rows, heads, past + longest, width]`` (``PromptLayer``): row r's ``padding[r]`` first positions
are unused and masked, its past follows, then its new tokens, whose keys and values the forward
writes in place. Position ids continue from ``past`` for every row, so each row's result is the
one of its tokens alone, and each row's whole KV is one view, ``[:, padding[r]:]`` (``row_kv``):
the past is copied once (into the forward's cache) and nothing is concatenated. The layers' memory
comes from the engine's ``ForwardScratch`` when it has one, kept from forward to forward (fresh
memory costs its page faults: two thirds of the copies' time at a 1024-token past): the views of a
forward's output are then valid until the next forward. With no past
and one row this is the plain forward of one prompt. ``logits_to_keep=1``: the logits are those of
each row's last token.

When every row's past is the same KV (one cached prefix, taken from the prefix cache by all of
them) and the model runs ``pdserve.model.shared_prefix_attention``, the past is not copied at all:
the forward attends to it once for all rows (``shared=True``), its cache layers (``OwnLayer``) keep
only the new tokens' keys and values, and a row's KV is in two parts, the shared past then its own
(``row_parts``).

A model whose cache layers are not plain full-attention layers (a sliding window, say) runs over
transformers' ``DynamicCache`` instead, its rows then laid out ``[past | padding | new]``
(``ForwardOutput.row_kv`` joins the two parts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from pdserve.kv.layout import KvLayout, unpack
from pdserve.model.compiled_forward import static_dims
from pdserve.model.engine_model import EngineModel
from pdserve.model.shared_prefix_attention import SharedPrefix
from prefill_service.prefix_cache import LayerKv

# Per layer, the keys and values of a batch: ``[rows, heads, tokens, width]`` each.
BatchKv = list[tuple[torch.Tensor, torch.Tensor]]


SCRATCH_MAX_BYTES = 512 << 20  # a forward whose cache needs more gets fresh memory, given back after


class ForwardScratch:
    """Memory for the forwards' caches, grown to the largest one needed (up to ``max_bytes``) and
    kept: one flat tensor per layer for keys and one for values."""

    def __init__(self, device: torch.device, max_bytes: int = SCRATCH_MAX_BYTES) -> None:
        self._device = device
        self._max_bytes = max_bytes
        self._flat: dict[tuple[int, str], torch.Tensor] = {}

    def tensor(
        self, layer: int, part: str, shape: tuple[int, ...], dtype: torch.dtype, total_bytes: int
    ) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` for ``part`` ("keys"/"values") of ``layer``; fresh
        memory when the forward's cache (``total_bytes`` over all layers) is over the bound."""
        if total_bytes > self._max_bytes:
            return torch.empty(shape, dtype=dtype, device=self._device)
        numel = 1
        for size in shape:
            numel *= size
        flat = self._flat.get((layer, part))
        if flat is None or flat.dtype != dtype or flat.numel() < numel:
            flat = torch.empty(numel, dtype=dtype, device=self._device)
            self._flat[(layer, part)] = flat
        return flat[:numel].view(shape)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._flat.values())


class _PastLayer(CacheLayerMixin):
    """A cache layer of a prefill forward that starts after ``past`` positions: a tensor whose last
    size is the past length (a size, so that compiled code keeps it symbolic)."""

    is_sliding = False

    def __init__(self, past: torch.Tensor) -> None:
        super().__init__()
        self._past = past
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._past.shape[-1] + query_length, 0

    def get_seq_length(self) -> int:
        return self._past.shape[-1]

    def get_max_length(self) -> int:
        return -1


class PromptLayer(_PastLayer):
    """One layer of a prefill forward's cache, allocated whole: the past is already in it, and the
    forward's new keys and values are written after it (each row's real tokens at the end)."""

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, past: torch.Tensor, slots: torch.Tensor | None
    ):
        """``keys``/``values``: ``[rows, heads, past + longest, width]``; ``slots``: ``[rows,
        longest]`` where each new position is written (None: at ``past`` onwards, no padding)."""
        super().__init__(past)
        self.keys, self.values = keys, values
        self._slots = slots

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self._slots
        if slots is None:
            past = self._past.shape[-1]
            self.keys[:, :, past:].copy_(key_states)
            self.values[:, :, past:].copy_(value_states)
        else:
            index = slots[:, None, :, None]
            self.keys.scatter_(2, index.expand(key_states.shape), key_states)
            self.values.scatter_(2, index.expand(value_states.shape), value_states)
        return self.keys, self.values


class OwnLayer(_PastLayer):
    """One layer of a forward over a shared past: it keeps the forward's own keys and values only
    (the attention reads the past apart)."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values = key_states, value_states
        return key_states, value_states


# A row's KV in pieces, in token order: (first position, per layer [heads, tokens, width]).
KvParts = list[tuple[int, LayerKv]]


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [rows, vocab]: each row's last position
    layers: BatchKv  # the cache after the forward: [rows, heads, past + longest new, width]
    past: int
    padding: list[int]  # left padding of each row's new tokens
    kept: torch.Tensor | None = None  # [rows, keep, vocab]: the last ``keep`` positions, when keep > 1
    past_first: bool = (
        False  # rows laid out [past | padding | new] (DynamicCache), not [padding | past | new]
    )
    shared_past: LayerKv | None = None  # the past every row shares, not in ``layers`` (``shared=True``)

    def row_parts(self, row: int) -> KvParts:
        """Row ``row``'s KV in pieces (views): the shared past and its own tokens, or one piece."""
        if self.shared_past is None:
            return [(0, self.row_kv(row))]
        pad = self.padding[row]
        return [
            (0, self.shared_past),
            (self.past, [(k[row, :, pad:], v[row, :, pad:]) for k, v in self.layers]),
        ]

    def row_kv(self, row: int) -> LayerKv:
        """Row ``row``'s KV, per layer ``[heads, tokens, width]`` (views, unless the rows are laid out
        past first and this one is padded, or share their past)."""
        if self.shared_past is not None:
            return joined(self.row_parts(row))
        pad = self.padding[row]
        if not self.past_first or pad == 0 or self.past == 0:
            return [(k[row, :, pad:], v[row, :, pad:]) for k, v in self.layers]
        p = self.past
        return [
            (
                torch.cat([k[row, :, :p], k[row, :, p + pad :]], 1),
                torch.cat([v[row, :, :p], v[row, :, p + pad :]], 1),
            )
            for k, v in self.layers
        ]


def run_forward(
    m: EngineModel,
    pasts: Sequence[LayerKv] | None,
    chunks: Sequence[Sequence[int]],
    keep: int = 1,
    whole: bool = True,
    scratch: ForwardScratch | None = None,
    shared: bool = False,
) -> ForwardOutput:
    """The forward of ``chunks`` (one row each) over ``pasts`` (each row's KV so far, all of one
    length; None: no past). ``keep`` > 1: the logits of the last ``keep`` positions are kept too
    (a request's prompt logprobs). ``whole``: the model's cache layers are plain (``laid_out_whole``)."""
    lengths = [len(c) for c in chunks]
    rows = len(chunks)
    # Rows of one new token each are padded to two: a length of 1 would be a compiled shape class of its own.
    longest = max(*lengths, 2 if rows > 1 else 1)
    padding = [longest - n for n in lengths]
    input_ids = torch.zeros((rows, longest), dtype=torch.long)
    mask = torch.zeros((rows, longest), dtype=torch.long)
    for row, chunk in enumerate(chunks):
        input_ids[row, padding[row] :] = torch.tensor(chunk)
        mask[row, padding[row] :] = 1
    past = pasts[0][0][0].shape[1] if pasts is not None else 0
    kwargs: dict[str, Any] = {}
    shared_past = pasts[0] if shared and pasts is not None else None
    if shared_past is not None:
        marker = torch.empty((0, past), device=m.device)
        cache: Cache = Cache(layers=[OwnLayer(marker) for _ in shared_past])
        full_mask = torch.cat([torch.ones((rows, past), dtype=torch.long), mask], 1)
        kwargs["shared_prefix"] = SharedPrefix([k for k, _ in shared_past], [v for _, v in shared_past])
    elif whole:
        cache = _prompt_cache(m, pasts, past, padding, longest, scratch)
        # Row r's masked positions are its first padding[r]: its past follows them.
        full_mask = (torch.arange(past + longest)[None] >= torch.tensor(padding)[:, None]).long()
    else:
        cache = _dynamic_cache(m, pasts)
        full_mask = torch.cat([torch.ones((rows, past), dtype=torch.long), mask], 1)
    if rows > 1:  # left padding: every row ends at the last position
        kwargs["attention_mask"] = full_mask.to(m.device)
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
        padding=padding,
        past_first=not whole,
        shared_past=shared_past,
    )


def joined(parts: KvParts) -> LayerKv:
    """The pieces of a row's KV as one new tensor per layer, keys and values."""
    layers = list(zip(*(piece for _, piece in parts), strict=True))
    return [(torch.cat([k for k, _ in layer], 1), torch.cat([v for _, v in layer], 1)) for layer in layers]


def pack_parts(buffer: torch.Tensor, parts: KvParts, layout: KvLayout, num_tokens: int) -> None:
    """Copies a row's KV, in pieces, into ``buffer`` (a packed buffer of ``num_tokens``)."""
    views = unpack(buffer, layout, num_tokens)
    for start, piece in parts:
        for (kd, vd), (k, v) in zip(views, piece, strict=True):
            kd[:, start : start + k.shape[1]].copy_(k)
            vd[:, start : start + v.shape[1]].copy_(v)


def _prompt_cache(
    m: EngineModel,
    pasts: Sequence[LayerKv] | None,
    past: int,
    padding: list[int],
    longest: int,
    scratch: ForwardScratch | None,
) -> Cache:
    """The forward's cache of ``PromptLayer``s, each row's past copied in after its padding."""
    rows = len(padding)
    slots = None
    if rows > 1:  # written by index even where no row is padded: one compiled shape class for batches
        # A padding position is written where the row's own padding is (masked); a real one after the past.
        positions = torch.arange(longest)[None].expand(rows, longest)
        slots = torch.where(positions < torch.tensor(padding)[:, None], positions, positions + past).to(
            m.device
        )
    marker = torch.empty((0, past), device=m.device)
    layers = []
    layout = m.kv_layout
    total = rows * layout.num_bytes(past + longest)

    def memory(layer: int, part: str, shape: tuple[int, ...]) -> torch.Tensor:
        if scratch is None:
            return torch.empty(shape, dtype=layout.dtype, device=m.device)
        return scratch.tensor(layer, part, shape, layout.dtype, total)

    for i, ((kh, kw), (vh, vw)) in enumerate(zip(layout.keys, layout.values, strict=True)):
        # Heads and width: the model's (``static_dims``; a dynamic head count would tie the rows to it).
        keys = static_dims(memory(i, "keys", (rows, kh, past + longest, kw)), 1, 3)
        values = static_dims(memory(i, "values", (rows, vh, past + longest, vw)), 1, 3)
        if pasts is not None:
            for row, row_past in enumerate(pasts):
                pad = padding[row]
                keys[row, :, pad : pad + past].copy_(row_past[i][0])
                values[row, :, pad : pad + past].copy_(row_past[i][1])
        layers.append(PromptLayer(keys, values, marker, slots))
    return Cache(layers=layers)


def _dynamic_cache(m: EngineModel, pasts: Sequence[LayerKv] | None) -> Cache:
    cache = DynamicCache(config=m.model.config)
    if pasts is not None:
        rows = len(pasts)
        for i, layer in enumerate(zip(*pasts, strict=True)):
            keys = torch.stack([k for k, _ in layer]) if rows > 1 else layer[0][0][None]
            values = torch.stack([v for _, v in layer]) if rows > 1 else layer[0][1][None]
            cache.update(keys, values, i)
    return cache
