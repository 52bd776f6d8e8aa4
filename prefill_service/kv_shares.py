"""One parked KV under several handles: the choices of a request with ``n`` > 1 share its prompt's KV.

The prompt runs forward once and its KV is packed once; each choice that goes on to decode gets a
handle of its own onto that one buffer (``KvRegistry.park_shared``). Every handle keeps the rules of
a handle (``prefill_service.kv_registry``): it leaves the registry exactly once (pulled, released or
expired) and its taker frees it, once. A ``SharedFree`` counts those frees: the buffer's memory goes
back when the last handle onto it is freed, whichever way each one ended. The buffer is read only
from then on (sent, or lent and read in place), so the handles never see each other's use of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class SharedFree:
    """Frees a buffer when each of its ``count`` shares has been freed (each share's free is
    idempotent: a second call of one share counts nothing)."""

    def __init__(self, free: Callable[[], None], count: int) -> None:
        if count < 1:
            raise ValueError(f"a shared KV needs at least one share, got {count}")
        self._free = free
        self._left = count
        self._lock = threading.Lock()

    @property
    def shares_left(self) -> int:
        return self._left

    def share(self) -> Callable[[], None]:
        """The free of one share (one handle's)."""
        done = False

        def free() -> None:
            nonlocal done
            with self._lock:
                if done:
                    return
                done = True
                self._left -= 1
                last = self._left == 0
            if last:
                self._free()

        return free
