"""The key-value store of one KV pair, kept in the prefill process: the two ends of the pair build
their torch.distributed group through it (gloo's and NCCL's rendezvous keys) and nothing else does.

The prefill's own end uses it in process (``store``, a ``HashStore``); the decode's end reaches it
through the Prefill service's ``PairStore`` call (``pdserve.kv.relay_store``), which only the pair's
owner can make (``pdserve.kv.pair_secret``). It is bounded: at most ``MAX_KEYS`` keys of at most
``MAX_KEY_CHARS`` characters and values of at most ``MAX_VALUE_BYTES``, and a relayed call waits at
most its timeout, polling (no thread is held while it waits). A store lives as long as its pair's
generation.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import torch.distributed as dist

MAX_KEYS = 64
MAX_KEY_CHARS = 256
MAX_VALUE_BYTES = 64 << 10
MAX_WAIT_KEYS = 16
MAX_CALLS_IN_FLIGHT = 4
POLL_S = 0.002
OPS = ("set", "get", "wait", "check", "add", "compare_set")


class StoreLimit(Exception):
    """A relayed call would exceed the store's bounds."""


class StoreTimeout(Exception):
    """The keys a relayed call waited for did not come in time."""


def call_problem(op: str, keys: list[str], value: bytes, expected: bytes) -> str | None:
    """Why a relayed call's fields are unusable, or None."""
    if op not in OPS:
        return f"op must be one of {OPS}"
    if not keys or len(keys) > (MAX_WAIT_KEYS if op in ("wait", "check") else 1):
        return f"keys must name one key (wait and check: up to {MAX_WAIT_KEYS})"
    if any(not key or len(key) > MAX_KEY_CHARS or not key.isprintable() for key in keys):
        return f"each key must be 1 to {MAX_KEY_CHARS} printable characters"
    if len(value) > MAX_VALUE_BYTES or len(expected) > MAX_VALUE_BYTES:
        return f"values are at most {MAX_VALUE_BYTES} bytes"
    return None


class PairStore:
    def __init__(self, timeout: timedelta) -> None:
        self.store = dist.HashStore()
        self.store.set_timeout(timeout)
        self._timeout_s = timeout.total_seconds()
        self._keys: set[str] = set()
        self._in_flight = 0

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    async def call(
        self, op: str, keys: list[str], value: bytes, expected: bytes, amount: int, timeout_s: float
    ) -> tuple[bytes, int, bool]:
        """One relayed operation (fields checked by ``call_problem``): (value, number, ready)."""
        if self._in_flight >= MAX_CALLS_IN_FLIGHT:
            raise StoreLimit(f"more than {MAX_CALLS_IN_FLIGHT} calls in flight on one pair store")
        self._in_flight += 1
        try:
            return await self._call(op, keys, value, expected, amount, timeout_s)
        finally:
            self._in_flight -= 1

    async def _call(
        self, op: str, keys: list[str], value: bytes, expected: bytes, amount: int, timeout_s: float
    ) -> tuple[bytes, int, bool]:
        key = keys[0]
        if op == "check":
            return b"", 0, self.store.check(keys)
        if op in ("get", "wait"):
            await self._wait(keys, timeout_s)
            return (self.store.get(key) if op == "get" else b""), 0, True
        self._admit(key)
        if op == "set":
            self.store.set(key, value)  # type: ignore[arg-type]  # bytes pass as they are
            return b"", 0, True
        if op == "add":
            return b"", self.store.add(key, amount), True
        return self.store.compare_set(key, expected, value), 0, True  # type: ignore[arg-type]

    def _admit(self, key: str) -> None:
        if key not in self._keys and len(self._keys) >= MAX_KEYS:
            raise StoreLimit(f"a pair store holds at most {MAX_KEYS} keys")
        self._keys.add(key)

    async def _wait(self, keys: list[str], timeout_s: float) -> None:
        """Until every key is set, within ``timeout_s`` (at most the pair's timeout)."""
        deadline = time.monotonic() + min(max(timeout_s, 0.0) or self._timeout_s, self._timeout_s)
        while not self.store.check(keys):
            if time.monotonic() >= deadline:
                raise StoreTimeout(f"keys {keys} not set in time")
            await asyncio.sleep(POLL_S)
