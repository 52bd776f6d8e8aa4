"""Where a decode gets a handle's KV from: pulled from a remote prefill, or taken in-process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdserve.v1 import kv_pb2

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class PulledKv:
    """A request's KV as per-layer (keys, values) ``[heads, T, width]``, until it is copied."""

    layers: Layers
    control_s: float = 0.0  # handle check, pull call, receive posted (or KV opened in place)
    data_s: float = 0.0  # receive posted -> every byte in (0 when read in place)
    transport: str = ""
    # Call once the KV has been copied (any thread): memory lent by a prefill goes back to it.
    release: Callable[[], None] = field(default=_nothing, compare=False)


class KvSource(Protocol):
    async def take(self, handle: kv_pb2.KvHandle) -> PulledKv:
        """The handle's KV; raises RpcError with the status to return."""
        ...

    async def close(self) -> None: ...
