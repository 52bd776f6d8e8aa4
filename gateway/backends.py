"""The gateway's connections to prefill and decode processes, and which one a request uses.

A pool probes the health of each of its backends (``gateway.backend_health``) and picks, among
those reporting SERVING, the one with the least outstanding requests (round robin among equals),
preferring backends a request has not failed on yet. When none is serving it waits up to
``PICK_WAIT_S`` for one (a backend starting or coming back) before failing with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc

from gateway.backend_health import BackendHealth, probe_forever
from pdserve.rpc.errors import RpcError
from pdserve.rpc.server import MESSAGE_SIZE_OPTIONS
from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc

StubT = TypeVar("StubT")

PICK_WAIT_S = 5.0

CHANNEL_OPTIONS = [
    *MESSAGE_SIZE_OPTIONS,
    # A backend that comes back (restarted on its address) is reconnected to within a second or two.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(eq=False)
class Backend(Generic[StubT]):
    address: str
    channel: grpc.aio.Channel
    stub: StubT
    health: BackendHealth
    outstanding: int = 0
    _probe: asyncio.Task[None] | None = field(default=None, repr=False)


class BackendPool(Generic[StubT]):
    def __init__(
        self, role: str, backends: Sequence[Backend[StubT]], pick_wait_s: float = PICK_WAIT_S
    ) -> None:
        if not backends:
            raise ValueError(f"a {role} pool needs at least one address")
        self.role = role
        self._backends = list(backends)
        self._order = itertools.cycle(range(len(self._backends)))
        self._pick_wait_s = pick_wait_s
        self._changed = asyncio.Event()
        for backend in self._backends:
            backend.health.subscribe(self.notify)
        with contextlib.suppress(RuntimeError):  # no running loop: probes start at the first pick
            self.start()

    @property
    def backends(self) -> list[Backend[StubT]]:
        return list(self._backends)

    @property
    def num_serving(self) -> int:
        return sum(1 for b in self._backends if b.health.serving)

    def start(self) -> None:
        """Starts the health probes (needs a running event loop)."""
        loop = asyncio.get_running_loop()
        for backend in self._backends:
            if backend._probe is None:
                backend._probe = loop.create_task(probe_forever(backend.channel, backend.health))

    def notify(self) -> None:
        """Wakes the picks waiting for a serving backend."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def pick(self, avoid: Collection[Backend[StubT]] = ()) -> Backend[StubT]:
        """A serving backend with the least outstanding requests; raises RpcError(UNAVAILABLE)."""
        self.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._pick_wait_s
        while True:
            backend = self.pick_now(avoid)
            if backend is not None:
                return backend
            remaining = deadline - loop.time()
            if remaining <= 0:
                states = ", ".join(
                    f"{b.address} ({b.health.state.value}: {b.health.reason})" for b in self._backends
                )
                raise RpcError(grpc.StatusCode.UNAVAILABLE, f"no {self.role} is serving: {states}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def pick_now(self, avoid: Collection[Backend[StubT]] = ()) -> Backend[StubT] | None:
        """``pick`` without waiting: None when no backend is serving now."""
        serving = [b for b in self._rotated() if b.health.serving]
        preferred = [b for b in serving if b not in avoid] or serving
        return min(preferred, key=lambda b: b.outstanding) if preferred else None

    def _rotated(self) -> list[Backend[StubT]]:
        start = next(self._order)
        return self._backends[start:] + self._backends[:start]

    async def close(self) -> None:
        for backend in self._backends:
            if backend._probe is not None:
                backend._probe.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await backend._probe
            await backend.channel.close()


def _pool(
    role: str, addresses: Sequence[str], stub_type: type[StubT], pick_wait_s: float
) -> BackendPool[StubT]:
    backends: list[Backend[StubT]] = []
    for address in addresses:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        backends.append(Backend(address, channel, stub_type(channel), BackendHealth(address)))  # type: ignore[call-arg]
    return BackendPool(role, backends, pick_wait_s)


def prefill_pool(
    addresses: Sequence[str], pick_wait_s: float = PICK_WAIT_S
) -> BackendPool[prefill_pb2_grpc.PrefillStub]:
    return _pool("prefill", addresses, prefill_pb2_grpc.PrefillStub, pick_wait_s)


def decode_pool(
    addresses: Sequence[str], pick_wait_s: float = PICK_WAIT_S
) -> BackendPool[decode_pb2_grpc.DecodeStub]:
    return _pool("decode", addresses, decode_pb2_grpc.DecodeStub, pick_wait_s)
