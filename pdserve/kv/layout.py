"""The layout of one request's KV cache and its packing into one flat byte buffer.

A model's KV layout is, per layer, the (heads, width) of its cached keys and of its cached values
and their dtype, measured from a one-token forward (MLA models cache keys and values of different
widths). For a request of T tokens the tensors are ``layers.{i}.keys [heads, T, width]`` then
``layers.{i}.values``, layer by layer, each starting at a 64-byte aligned offset of the buffer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.v1 import kv_pb2

ALIGN = 64


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    def to_proto(self) -> kv_pb2.TensorSpec:
        return kv_pb2.TensorSpec(name=self.name, shape=list(self.shape), dtype=dtype_name(self.dtype))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def spec_from_proto(msg: kv_pb2.TensorSpec) -> TensorSpec:
    return TensorSpec(msg.name, tuple(msg.shape), dtype_from_name(msg.dtype))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class KvLayout:
    """Per layer: (heads, width) of keys and of values; one dtype for all."""

    keys: tuple[tuple[int, int], ...]
    values: tuple[tuple[int, int], ...]
    dtype: torch.dtype

    @classmethod
    def from_cache_layers(cls, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> KvLayout:
        """From one request's cache tensors ``[1, heads, T, width]``."""
        return cls(
            keys=tuple((k.shape[1], k.shape[3]) for k, _ in layers),
            values=tuple((v.shape[1], v.shape[3]) for _, v in layers),
            dtype=layers[0][0].dtype,
        )

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def tensor_specs(self, num_tokens: int) -> list[TensorSpec]:
        return list(self._specs(num_tokens))

    @functools.lru_cache(maxsize=512)  # noqa: B019 (the layout is immutable and lives as long as its engine)
    def _specs(self, num_tokens: int) -> tuple[TensorSpec, ...]:
        specs = []
        for i, ((kh, kw), (vh, vw)) in enumerate(zip(self.keys, self.values, strict=True)):
            specs.append(TensorSpec(f"layers.{i}.keys", (kh, num_tokens, kw), self.dtype))
            specs.append(TensorSpec(f"layers.{i}.values", (vh, num_tokens, vw), self.dtype))
        return tuple(specs)

    @functools.lru_cache(maxsize=512)  # noqa: B019
    def num_bytes(self, num_tokens: int) -> int:
        return sum(_aligned(s.num_bytes) for s in self._specs(num_tokens))

    @functools.lru_cache(maxsize=512)  # noqa: B019
    def element_offsets(self, num_tokens: int) -> tuple[int, ...]:
        """Where each tensor starts in a packed buffer, in elements of the dtype (every offset is a
        multiple of ``ALIGN`` bytes, so of the element size)."""
        offsets, offset = [], 0
        for spec in self._specs(num_tokens):
            offsets.append(offset // self.dtype.itemsize)
            offset += _aligned(spec.num_bytes)
        return tuple(offsets)

    def bytes_per_token(self) -> int:
        return sum(s.num_bytes for s in self.tensor_specs(1))


def pack(
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layout: KvLayout,
    row: int,
    start: int,
    num_tokens: int,
    device: torch.device,
) -> torch.Tensor:
    """Copies positions [start, start + num_tokens) of batch row ``row`` into a new uint8 buffer."""
    buf = torch.empty(layout.num_bytes(num_tokens), dtype=torch.uint8, device=device)
    pack_into(buf, layers, layout, row, start, num_tokens)
    return buf


def pack_into(
    buf: torch.Tensor,
    layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layout: KvLayout,
    row: int,
    start: int,
    num_tokens: int,
) -> None:
    """Copies positions [start, start + num_tokens) of batch row ``row`` into ``buf`` (uint8, sized
    by ``layout.num_bytes``)."""
    views = unpack(buf, layout, num_tokens)
    for (k, v), (kd, vd) in zip(layers, views, strict=True):
        kd.copy_(k[row, :, start : start + num_tokens])
        vd.copy_(v[row, :, start : start + num_tokens])


def unpack(buf: torch.Tensor, layout: KvLayout, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Views ``[heads, T, width]`` of the keys and values of every layer inside a packed buffer."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != layout.num_bytes(num_tokens):
        raise ValueError(
            f"buffer must be 1-D uint8 of {layout.num_bytes(num_tokens)} bytes, "
            f"got {buf.dtype} {tuple(buf.shape)}"
        )
    flat = buf.view(layout.dtype)  # one view, then each tensor a strided window of it
    base = flat.storage_offset()  # as_strided counts from the start of the storage
    views = [
        flat.as_strided(spec.shape, _contiguous_strides(spec.shape), base + offset)
        for spec, offset in zip(
            layout.tensor_specs(num_tokens), layout.element_offsets(num_tokens), strict=True
        )
    ]
    return [(views[i], views[i + 1]) for i in range(0, len(views), 2)]
