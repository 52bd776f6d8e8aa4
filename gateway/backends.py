"""The gateway's connections to prefill and decode processes, and which one a request uses.

A pool probes the health of each of its backends (``gateway.backend_health``) and picks, among
those reporting SERVING, the one with the least outstanding requests (round robin among equals),
preferring backends a request has not failed on yet. When none is serving it waits up to
``PICK_WAIT_S`` for one (a backend starting or coming back) before failing with UNAVAILABLE.

Its members can change while it runs (``update``: the addresses found by ``gateway.discovery``):
1. a new address gets a channel and a health probe; it is picked once its probe says SERVING;
2. an address that is gone is *retired*: never picked again, while the requests using it go on
   (its probe keeps watching them);
3. a retired backend is closed (probe stopped, channel closed) at the first update after nothing
   uses it any more: no call in flight (``outstanding``) and no parked KV of a request (``holds``);
4. a retired address that comes back before it is closed serves again as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc

from gateway.backend_health import BackendHealth, probe_forever
from pdserve.rpc.channel_security import PLAIN, ChannelSecurity
from pdserve.rpc.errors import RpcError
from pdserve.rpc.server import MESSAGE_SIZE_OPTIONS
from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc

logger = logging.getLogger(__name__)

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
    outstanding: int = 0  # calls in flight (what picks balance)
    pending_tokens: int = 0  # prompt tokens its calls in flight are expected to compute (prefix routing)
    holds: int = 0  # requests holding something on it for later calls (a parked KV to release)
    _probe: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def in_use(self) -> bool:
        return self.outstanding > 0 or self.holds > 0

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None
        await self.channel.close()


Connect = Callable[[str], Backend[StubT]]
# Takes one of the serving backends (in rotated order) offered for a request.
Chooser = Callable[[Sequence[Backend[StubT]]], Backend[StubT]]


class BackendPool(Generic[StubT]):
    def __init__(
        self,
        role: str,
        backends: Sequence[Backend[StubT]],
        pick_wait_s: float = PICK_WAIT_S,
        connect: Connect[StubT] | None = None,
    ) -> None:
        self.role = role
        self._backends = list(backends)
        self._retired: list[Backend[StubT]] = []
        self._closing: set[asyncio.Task[None]] = set()
        self._connect = connect
        self._order = itertools.count()
        self._pick_wait_s = pick_wait_s
        self._changed = asyncio.Event()
        self._closed_listeners: list[Callable[[Backend[StubT]], None]] = []
        for backend in self._backends:
            backend.health.subscribe(self.notify)
        with contextlib.suppress(RuntimeError):  # no running loop: probes start at the first pick
            self.start()

    @property
    def backends(self) -> list[Backend[StubT]]:
        """The backends requests are routed to (retired ones excluded)."""
        return list(self._backends)

    @property
    def retired(self) -> list[Backend[StubT]]:
        """Backends gone from the pool's addresses whose requests are still running."""
        return list(self._retired)

    @property
    def num_serving(self) -> int:
        return sum(1 for b in self._backends if b.health.serving)

    def on_closed(self, listener: Callable[[Backend[StubT]], None]) -> None:
        """Calls ``listener(backend)`` when a retired backend is closed."""
        self._closed_listeners.append(listener)

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

    def update(self, addresses: Iterable[str]) -> None:
        """Makes ``addresses`` the pool's members (see the module docstring); needs a running loop."""
        if self._connect is None:
            raise RuntimeError(f"the {self.role} pool has fixed addresses")
        wanted = list(dict.fromkeys(addresses))
        current = {b.address: b for b in self._backends}
        retired = {b.address: b for b in self._retired}
        members: list[Backend[StubT]] = []
        for address in wanted:
            backend = current.get(address) or retired.get(address)
            if backend is None:
                backend = self._connect(address)
                backend.health.subscribe(self.notify)
                logger.info("%s %s joined the pool (routed once SERVING)", self.role, address)
            elif address in retired:
                logger.info("%s %s is back in the pool", self.role, address)
            members.append(backend)
        for backend in self._backends:
            if backend.address not in wanted:
                logger.info(
                    "%s %s left the pool: no new requests, %d calls in flight finish there",
                    self.role,
                    backend.address,
                    backend.outstanding,
                )
        self._retired = [b for b in [*self._retired, *self._backends] if b.address not in wanted]
        self._backends = members
        self.start()
        self._close_unused()
        self.notify()

    def _close_unused(self) -> None:
        for backend in [b for b in self._retired if not b.in_use]:
            self._retired.remove(backend)
            task = asyncio.get_running_loop().create_task(self._close_retired(backend))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close_retired(self, backend: Backend[StubT]) -> None:
        await backend.close()
        logger.info("%s %s closed (left the pool, nothing running there)", self.role, backend.address)
        for listener in self._closed_listeners:
            listener(backend)

    async def pick(
        self, avoid: Collection[Backend[StubT]] = (), choose: Chooser[StubT] | None = None
    ) -> Backend[StubT]:
        """A serving backend with the least outstanding requests (or the one ``choose`` takes of the
        serving ones); raises RpcError(UNAVAILABLE)."""
        self.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._pick_wait_s
        while True:
            backend = self.pick_now(avoid, choose)
            if backend is not None:
                return backend
            remaining = deadline - loop.time()
            if remaining <= 0:
                states = ", ".join(
                    f"{b.address} ({b.health.state.value}: {b.health.reason})" for b in self._backends
                )
                raise RpcError(
                    grpc.StatusCode.UNAVAILABLE, f"no {self.role} is serving: {states or 'none found'}"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def pick_now(
        self, avoid: Collection[Backend[StubT]] = (), choose: Chooser[StubT] | None = None
    ) -> Backend[StubT] | None:
        """``pick`` without waiting: None when no backend is serving now."""
        serving = [b for b in self._rotated() if b.health.serving]
        preferred = [b for b in serving if b not in avoid] or serving
        if not preferred:
            return None
        return choose(preferred) if choose is not None else min(preferred, key=lambda b: b.outstanding)

    def _rotated(self) -> list[Backend[StubT]]:
        if not self._backends:
            return []
        start = next(self._order) % len(self._backends)
        return self._backends[start:] + self._backends[:start]

    async def close(self) -> None:
        for backend in [*self._backends, *self._retired]:
            await backend.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _connector(stub_type: type[StubT], security: ChannelSecurity) -> Connect[StubT]:
    def connect(address: str) -> Backend[StubT]:
        channel = security.aio_channel(address, options=CHANNEL_OPTIONS)
        return Backend(address, channel, stub_type(channel), BackendHealth(address))  # type: ignore[call-arg]

    return connect


def _pool(
    role: str,
    addresses: Sequence[str],
    stub_type: type[StubT],
    pick_wait_s: float,
    security: ChannelSecurity,
) -> BackendPool[StubT]:
    connect = _connector(stub_type, security)
    return BackendPool(role, [connect(a) for a in addresses], pick_wait_s, connect)


def prefill_pool(
    addresses: Sequence[str], pick_wait_s: float = PICK_WAIT_S, security: ChannelSecurity = PLAIN
) -> BackendPool[prefill_pb2_grpc.PrefillStub]:
    """The prefills; ``security``: how the gateway calls them (the internal token, mutual TLS)."""
    return _pool("prefill", addresses, prefill_pb2_grpc.PrefillStub, pick_wait_s, security)


def decode_pool(
    addresses: Sequence[str], pick_wait_s: float = PICK_WAIT_S, security: ChannelSecurity = PLAIN
) -> BackendPool[decode_pb2_grpc.DecodeStub]:
    """The decodes; ``security`` as in ``prefill_pool``."""
    return _pool("decode", addresses, decode_pb2_grpc.DecodeStub, pick_wait_s, security)
