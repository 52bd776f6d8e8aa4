"""The decode side of the KV handoff: gets a handle's KV from the prefill that parked it.

Lifecycle of a pull:
1. check the handle against this decode's model and place (``pdserve.kv.handle``: version,
   fingerprint, layout, and the transport both ends can use) before any byte moves; a mismatch is
   FAILED_PRECONDITION;
2. queue on the link to that prefill over that transport (``PairLink`` for gloo/NCCL,
   ``LocalLink`` for shm/cuda-ipc); under the link's lock, one PullKvMany takes every pull queued
   by then (a burst of requests costs one round trip per lock holder, not one per request; a
   handle the prefill no longer holds is NOT_FOUND for its pull). Lock plus shielding keep the
   order of receives equal to the order of the prefill's sends even if a request is cancelled;
3. network: wait (bounded) for the data to arrive in this decode's buffer; same host: the KV is
   read in place from the prefill's memory, lent to this decode until ``release``;
4. return views of every layer's keys and values.

Every wait is bounded by the transfer timeout. Failures on the prefill's side (dead or hung prefill,
failed transfer) are ABORTED: the request can be run again from a new prefill.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import grpc
import torch

from decode_service.known_prefills import KnownPrefills
from decode_service.kv_source import Layers, PulledKv
from decode_service.local_link import LocalLink
from decode_service.metrics import DecodeMetrics
from decode_service.pair_link import (
    Allocator,
    PairLink,
    ReceiveBufferError,
    ReceiveCounter,
    Received,
    allocate,
)
from pdserve.kv.channel import TransferError, transfer_threads
from pdserve.kv.handle import HandleCheck, malformed, prefill_place
from pdserve.kv.layout import KvLayout, unpack
from pdserve.kv.shared_memory import InstanceLock, is_instance_id
from pdserve.kv.transports import NETWORK, Place
from pdserve.rpc.channel_security import PLAIN, ChannelSecurity
from pdserve.rpc.errors import RpcError
from pdserve.v1 import kv_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

MAX_LINKS = 256


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class _Fetched:
    buffer: torch.Tensor
    done: object | None  # the receive's future (network), None when read in place
    release: Callable[[], None]


@dataclass
class _Queue:
    """Pulls waiting for one link's lock."""

    link: PairLink | LocalLink
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiting: list[_Wanted] = field(default_factory=list)


@dataclass(eq=False)
class _Wanted:
    handle: kv_pb2.KvHandle
    posted: asyncio.Future[_Fetched]


class KvPuller:
    def __init__(
        self,
        instance_id: str,
        fingerprint: str,
        layout: KvLayout,
        kv_backend: str,
        device: torch.device,
        local_host: str,
        timeout: timedelta,
        metrics: DecodeMetrics,
        place: Place | None = None,
        shm_dir: str = "",
        allocator: Allocator = allocate,
        max_links: int = MAX_LINKS,
        known_prefills: KnownPrefills | None = None,
        security: ChannelSecurity = PLAIN,
    ) -> None:
        """``kv_backend`` narrows the transports this decode takes (``auto``: any); ``place`` is where
        this decode keeps KV (its shared-memory domain makes same-host transports possible);
        ``allocator`` makes the receive buffers of network pulls; at most ``max_links`` links to
        prefills are kept (the least recently used idle one is closed to make room); a handle is
        pulled only from ``known_prefills`` (by default: prefills of this host); ``security``: how it
        calls the prefills (the internal token, mutual TLS)."""
        self._known = known_prefills if known_prefills is not None else KnownPrefills(())
        self._instance_id = instance_id
        self._allocator = allocator
        self._max_links = max_links
        self._security = security
        self._layout = layout
        self._device = device
        self._local_host = local_host
        self._timeout = timeout
        self._metrics = metrics
        self._shm_dir = Path(shm_dir)
        place = place or Place("", str(device))
        self._lock: InstanceLock | None = None
        if place.host_id and shm_dir and is_instance_id(instance_id):
            self._lock = InstanceLock(self._shm_dir, instance_id)  # the prefills watch it
        elif place.host_id:
            place = Place("", place.device, place.device_uuid, place.visible_gpus)
        self._place = place
        self._check = HandleCheck(fingerprint, layout, kv_backend, place)
        self._queues: collections.OrderedDict[tuple[str, str], _Queue] = collections.OrderedDict()
        self._grpc: dict[str, tuple[grpc.aio.Channel, prefill_pb2_grpc.PrefillStub]] = {}
        self._blocking: dict[str, tuple[grpc.Channel, prefill_pb2_grpc.PrefillStub]] = {}
        self._receiving = ReceiveCounter()
        self._closing: set[asyncio.Future[None]] = set()
        metrics.kv_pairs.set_function(lambda: self.num_pairs)
        metrics.kv_receives_in_flight.set_function(lambda: self._receiving.value)
        metrics.kv_transfer_threads.set_function(transfer_threads)
        metrics.kv_borrowed.set_function(lambda: self.num_borrowed)

    @property
    def num_pairs(self) -> int:
        """Network pairs with a usable channel (one per prefill this decode pulls from)."""
        return sum(1 for q in list(self._queues.values()) if isinstance(q.link, PairLink) and q.link.is_open)

    @property
    def num_receiving(self) -> int:
        return self._receiving.value

    @property
    def num_borrowed(self) -> int:
        """KVs read in place from a prefill of this host and not given back yet."""
        return sum(q.link.borrowed for q in list(self._queues.values()) if isinstance(q.link, LocalLink))

    def check_compatible(self, handle: kv_pb2.KvHandle) -> str:
        """The transport this decode takes the handle's KV by; raises RpcError: INVALID_ARGUMENT for a
        malformed handle, FAILED_PRECONDITION for one it cannot use (before any connection)."""
        bad = malformed(handle)
        if bad is not None:
            self._metrics.kv_refused.inc()
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, bad)
        problem = self._check.problem(handle)
        transport = self._check.transport(handle)
        if problem is not None or transport is None:
            self._metrics.kv_refused.inc()
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, problem or "no transport")
        return transport

    async def pull(self, handle: kv_pb2.KvHandle) -> Layers:
        """The handle's KV as per-layer (keys, values) ``[heads, T, width]`` in this decode's own
        memory (a KV read in place is copied out and given back)."""
        pulled = await self.pull_timed(handle)
        if pulled.transport in NETWORK:
            return pulled.layers
        try:
            return [(k.clone(), v.clone()) for k, v in pulled.layers]
        finally:
            pulled.release()

    async def take(self, handle: kv_pb2.KvHandle) -> PulledKv:
        """The handle's KV, read in place when it lies in this host's memory (``release`` gives it
        back once copied)."""
        return await self.pull_timed(handle)

    async def pull_timed(self, handle: kv_pb2.KvHandle) -> PulledKv:
        """The handle's KV, with the time spent in control and in data; a KV read in place must be
        given back with ``release`` once copied."""
        started = time.perf_counter()
        transport = self.check_compatible(handle)
        if not await self._known.check(handle.prefill_address):
            self._metrics.kv_refused.inc()
            raise RpcError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"kv_handle names prefill {handle.prefill_address}, which is not one this decode "
                "pulls from (--prefill)",
            )
        # Shielded: once the pull call may have posted the prefill's send, the receive must be posted
        # too; and a KV lent to this decode must go back even if the caller is gone.
        posted = asyncio.ensure_future(self._post(handle, transport))
        try:
            fetched = await asyncio.shield(posted)
        except asyncio.CancelledError:
            posted.add_done_callback(_release_when_done)
            raise
        except BaseException as exc:
            raise self._failure(handle, exc) from exc
        control_done = time.perf_counter()
        if fetched.done is not None:
            try:
                await asyncio.wrap_future(fetched.done)  # type: ignore[arg-type]
            except BaseException as exc:
                raise self._failure(handle, exc) from exc
        data_done = time.perf_counter()
        self._metrics.kv_pulls.inc()
        self._metrics.kv_transport_pulls.labels(transport).inc()
        self._metrics.kv_received_bytes.inc(handle.num_bytes)
        self._metrics.kv_pull_seconds.observe(data_done - started)
        layers = unpack(fetched.buffer, self._layout, handle.num_tokens)
        return PulledKv(layers, control_done - started, data_done - control_done, transport, fetched.release)

    def _failure(self, handle: kv_pb2.KvHandle, exc: BaseException) -> BaseException:
        """The status a failed pull answers with."""
        if isinstance(exc, asyncio.CancelledError):
            return exc
        self._metrics.kv_pull_failures.inc()
        if isinstance(exc, RpcError):
            return exc
        if isinstance(exc, grpc.aio.AioRpcError):
            code = exc.code()
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                return RpcError(code, f"PullKvMany on {handle.prefill_address}: {exc.details()}")
            return RpcError(
                grpc.StatusCode.ABORTED,
                f"PullKvMany on prefill {handle.prefill_address} failed ({code.name}: {exc.details()})",
            )
        if isinstance(exc, ReceiveBufferError):
            return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV receive failed: {exc}")
        if isinstance(exc, TransferError | OSError | ValueError):
            return RpcError(
                grpc.StatusCode.ABORTED, f"KV transfer from prefill {handle.prefill_address} failed: {exc}"
            )
        return exc

    async def _post(self, handle: kv_pb2.KvHandle, transport: str) -> _Fetched:
        """The handle's pull; pulls that queue on a link while another holds its lock go together in
        one PullKvMany, once the lock is free."""
        queue = self._queue(handle, transport)
        wanted = _Wanted(handle, asyncio.get_running_loop().create_future())
        queue.waiting.append(wanted)
        async with queue.lock:
            if not wanted.posted.done():  # nobody took it along: take every pull queued by now
                batch, queue.waiting = queue.waiting, []
                await self._fetch(queue.link, batch)
        return wanted.posted.result()

    async def _fetch(self, link: PairLink | LocalLink, batch: list[_Wanted]) -> None:
        """One pull call for ``batch`` (under the link's lock); each pull's outcome to its future."""
        handles = [w.handle for w in batch]
        try:
            results = await link.fetch(handles)
        except asyncio.CancelledError:
            for w in batch:
                w.posted.cancel()
            raise
        except Exception as exc:
            for w in batch:
                w.posted.set_exception(exc)
            return
        for w, result in zip(batch, results, strict=True):
            if result is None:
                w.posted.set_exception(
                    RpcError(grpc.StatusCode.NOT_FOUND, "KV handle is unknown, expired or already pulled")
                )
            elif isinstance(result, Received):
                w.posted.set_result(_Fetched(result.buffer, result.done, _nothing))
            elif isinstance(link, LocalLink):
                w.posted.set_result(_Fetched(result, None, _once(link, w.handle)))

    def _queue(self, handle: kv_pb2.KvHandle, transport: str) -> _Queue:
        key = (handle.prefill_instance_id, transport)
        queue = self._queues.get(key)
        if queue is not None:
            self._queues.move_to_end(key)
        else:
            self._make_room()
            stub = self._stub(handle.prefill_address)
            link: PairLink | LocalLink
            if transport in NETWORK:
                link = PairLink(
                    self._instance_id,
                    handle.prefill_instance_id,
                    stub,
                    self._blocking_stub(handle.prefill_address),
                    transport,
                    self._device,
                    self._local_host,
                    self._timeout,
                    self._metrics,
                    self._receiving,
                    self._allocator,
                )
            else:
                link = LocalLink(
                    self._instance_id,
                    handle.prefill_instance_id,
                    stub,
                    transport,
                    self._place,
                    prefill_place(handle),
                    self._shm_dir,
                    self._timeout,
                    self._metrics,
                )
            queue = self._queues[key] = _Queue(link)
        return queue

    def _make_room(self) -> None:
        """Closes the least recently used idle link when there are ``max_links``."""
        if len(self._queues) < self._max_links:
            return
        for key, queue in self._queues.items():
            if not queue.lock.locked() and not queue.waiting and not _busy(queue.link):
                del self._queues[key]
                if isinstance(queue.link, PairLink):
                    queue.link.close("too many links")
                else:
                    closing = asyncio.ensure_future(queue.link.close())
                    self._closing.add(closing)
                    closing.add_done_callback(self._closing.discard)
                self._metrics.kv_link_evictions.inc()
                return
        raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {self._max_links} KV links are busy")

    def _stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        if address not in self._grpc:
            channel = self._security.aio_channel(address)
            self._grpc[address] = (channel, prefill_pb2_grpc.PrefillStub(channel))
        return self._grpc[address][1]

    def _blocking_stub(self, address: str) -> prefill_pb2_grpc.PrefillStub:
        """A blocking stub (pair-store calls run on a pair's transfer thread)."""
        if address not in self._blocking:
            channel = self._security.channel(address)
            self._blocking[address] = (channel, prefill_pb2_grpc.PrefillStub(channel))
        return self._blocking[address][1]

    async def close(self) -> None:
        for queue in self._queues.values():
            if isinstance(queue.link, PairLink):
                queue.link.close("decode closing")
            else:
                await queue.link.close()
        for channel, _ in self._grpc.values():
            await channel.close()
        for blocking, _ in self._blocking.values():
            blocking.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        self._queues.clear()
        self._grpc.clear()
        self._blocking.clear()
        if self._lock is not None:
            self._lock.release()


def _busy(link: PairLink | LocalLink) -> bool:
    """Whether a link still has work out: a receive posted, or a KV lent and not given back."""
    if isinstance(link, PairLink):
        return link.channel is not None and link.channel.num_pending > 0
    return link.borrowed > 0


def _once(link: LocalLink, handle: kv_pb2.KvHandle) -> Callable[[], None]:
    """Gives a lent KV back the first time it is called."""
    done = False

    def release() -> None:
        nonlocal done
        if not done:
            done = True
            link.give_back(handle)

    return release


def _release_when_done(posted: asyncio.Future[_Fetched]) -> None:
    """A pull whose caller went away: a KV lent to it goes straight back."""
    if not posted.cancelled() and posted.exception() is None:
        posted.result().release()
