"""Where a decode gets a handle's KV from: pulled from a remote prefill, or taken in-process."""

from __future__ import annotations

from typing import Protocol

import torch

from pdserve.v1 import kv_pb2


class KvSource(Protocol):
    async def pull(self, handle: kv_pb2.KvHandle) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) ``[heads, T, width]``; raises RpcError with the status to return."""
        ...

    async def close(self) -> None: ...
