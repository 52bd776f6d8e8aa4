"""Where a prefill parks the KV it computes, and what each parked KV can be moved by.

A CPU prefill with a shared-memory arena packs a KV straight into a region of it, so that a decode of
the same host reads it in place (``shm``); one that does not fit, or a prefill without an arena,
packs into private memory on its device. Each buffer knows the transports its handle offers
(``pdserve.kv.transports.offers``) and gives its memory back exactly once (``free``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from pdserve.kv.shared_memory import SharedArena
from pdserve.kv.transports import Place, offers

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class ParkedBuffer:
    tensor: torch.Tensor
    transports: tuple[str, ...]
    arena_offset: int | None = None  # where it sits in the arena; None: private memory
    _space: KvSpace | None = field(default=None, repr=False)

    def free(self) -> None:
        """Gives the memory back (idempotent)."""
        space, self._space = self._space, None
        if space is not None:
            space.give_back(self)


class KvSpace:
    """Allocates parked KV buffers: arena regions when possible, private memory otherwise."""

    def __init__(
        self, kv_backend: str, place: Place, device: torch.device, arena: SharedArena | None = None
    ) -> None:
        self._kv_backend = kv_backend
        self._place = place
        self._device = device
        self._arena = arena
        self._lock = threading.Lock()  # the engine thread allocates, the event loop frees
        self.num_arena_misses = 0

    @property
    def arena(self) -> SharedArena | None:
        return self._arena

    @property
    def arena_bytes_used(self) -> int:
        return self._arena.used if self._arena is not None else 0

    def allocate(self, num_bytes: int) -> ParkedBuffer:
        region = None
        if self._arena is not None:
            with self._lock:
                region = self._arena.allocate(num_bytes)
            if region is None:
                self.num_arena_misses += 1
                logger.warning("KV arena full: %d bytes parked in private memory", num_bytes)
        if region is not None:
            offset, tensor = region
            return ParkedBuffer(tensor, offers(self._kv_backend, self._place, True), offset, self)
        tensor = torch.empty(num_bytes, dtype=torch.uint8, device=self._device)
        return ParkedBuffer(tensor, offers(self._kv_backend, self._place, False), None, self)

    def give_back(self, buffer: ParkedBuffer) -> None:
        if buffer.arena_offset is not None and self._arena is not None:
            with self._lock:
                self._arena.free(buffer.arena_offset, buffer.tensor.numel())

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
