"""Parked KV caches under leases, in the prefill process.

Lifecycle of a handle: parked (after the prefill forward) -> taken by a pull (then sent and
freed) | released by the gateway | expired when its lease ends unpulled. A handle leaves the
registry exactly once, whichever comes first; later pulls get NOT_FOUND.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.kv.handle import new_handle_id


@dataclass(frozen=True)
class ParkedKv:
    handle_id: bytes
    buffer: torch.Tensor
    num_tokens: int
    expires_at: float  # time.monotonic() deadline
    expires_at_unix: float

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel()


class KvRegistry:
    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._lease_s = lease_s
        self._clock = clock
        self._entries: dict[bytes, ParkedKv] = {}
        self._lock = threading.Lock()

    def park(self, buffer: torch.Tensor, num_tokens: int) -> ParkedKv:
        entry = ParkedKv(
            handle_id=new_handle_id(),
            buffer=buffer,
            num_tokens=num_tokens,
            expires_at=self._clock() + self._lease_s,
            expires_at_unix=time.time() + self._lease_s,
        )
        with self._lock:
            self._entries[entry.handle_id] = entry
        return entry

    def take(self, handle_id: bytes) -> ParkedKv | None:
        """Removes and returns a live handle (for a pull), or None when unknown or expired."""
        with self._lock:
            entry = self._entries.get(handle_id)
            if entry is None or entry.expires_at <= self._clock():
                return None
            del self._entries[handle_id]
            return entry

    def release(self, handle_id: bytes) -> bool:
        with self._lock:
            return self._entries.pop(handle_id, None) is not None

    def expire(self) -> list[ParkedKv]:
        """Removes and returns every handle whose lease has ended."""
        now = self._clock()
        with self._lock:
            expired = [e for e in self._entries.values() if e.expires_at <= now]
            for entry in expired:
                del self._entries[entry.handle_id]
        return expired

    @property
    def num_parked(self) -> int:
        return len(self._entries)

    @property
    def num_bytes_parked(self) -> int:
        with self._lock:
            return sum(e.num_bytes for e in self._entries.values())
