"""Parked KV caches under leases, in the prefill process.

Lifecycle of a handle: parked (after the prefill forward) -> taken by a pull (then sent, or lent to
a decode of the same host, and freed by the taker) | released by the gateway | expired when its
lease ends unpulled (freed here). A handle leaves the registry exactly once, whichever comes first;
later pulls get NOT_FOUND. The choices of one request (``n`` > 1) park one buffer under a handle
each (``park_shared``, ``prefill_service.kv_shares``): freed when the last of them is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.kv.handle import new_handle_id
from pdserve.kv.transports import GLOO
from prefill_service.kv_shares import SharedFree
from prefill_service.kv_space import ParkedBuffer


@dataclass(frozen=True)
class ParkedKv:
    handle_id: bytes
    buffer: torch.Tensor
    num_tokens: int
    expires_at: float  # time.monotonic() deadline
    expires_at_unix: float
    transports: tuple[str, ...] = (GLOO,)  # what the handle offers
    arena_offset: int | None = None  # where it sits in the shared-memory arena, if it does
    free: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel()


class KvRegistry:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._lease_s = lease_s
        self._clock = clock
        self._entries: dict[bytes, ParkedKv] = {}
        self._lock = threading.Lock()

    def park(self, buffer: torch.Tensor | ParkedBuffer, num_tokens: int) -> ParkedKv:
        """Parks a packed KV (a plain tensor is private memory moved over gloo)."""
        parked = buffer if isinstance(buffer, ParkedBuffer) else ParkedBuffer(buffer, (GLOO,))
        entry = self._entry(parked, num_tokens, parked.free)
        with self._lock:
            self._entries[entry.handle_id] = entry
        return entry

    def park_shared(self, buffer: ParkedBuffer, num_tokens: int, count: int) -> list[ParkedKv]:
        """Parks one packed KV under ``count`` handles; its memory goes back when the last one is
        freed (pulled and sent or given back, released, or expired)."""
        shared = SharedFree(buffer.free, count)
        entries = [self._entry(buffer, num_tokens, shared.share()) for _ in range(count)]
        with self._lock:
            self._entries.update((entry.handle_id, entry) for entry in entries)
        return entries

    def _entry(self, parked: ParkedBuffer, num_tokens: int, free: Callable[[], None]) -> ParkedKv:
        return ParkedKv(
            handle_id=new_handle_id(),
            buffer=parked.tensor,
            num_tokens=num_tokens,
            expires_at=self._clock() + self._lease_s,
            expires_at_unix=time.time() + self._lease_s,
            transports=parked.transports,
            arena_offset=parked.arena_offset,
            free=free,
        )

    def take(self, handle_id: bytes, transport: str | None = None) -> ParkedKv | None:
        """Removes and returns a live handle for a pull over ``transport`` (None: any), or None when
        it is unknown, expired or not offered over that transport. The taker frees it."""
        with self._lock:
            entry = self._entries.get(handle_id)
            if entry is None or entry.expires_at <= self._clock():
                return None
            if transport is not None and transport not in entry.transports:
                return None
            del self._entries[handle_id]
            return entry

    def release(self, handle_id: bytes) -> bool:
        with self._lock:
            entry = self._entries.pop(handle_id, None)
        if entry is None:
            return False
        entry.free()
        return True

    def expire(self) -> list[ParkedKv]:
        """Removes and returns every handle whose lease has ended."""
        now = self._clock()
        with self._lock:
            expired = [e for e in self._entries.values() if e.expires_at <= now]
            for entry in expired:
                del self._entries[entry.handle_id]
        for entry in expired:
            entry.free()
        return expired

    @property
    def num_parked(self) -> int:
        return len(self._entries)

    @property
    def num_bytes_parked(self) -> int:
        with self._lock:  # a buffer shared by several handles counts once
            return sum({id(e.buffer): e.num_bytes for e in self._entries.values()}.values())
