"""A decode's link to one prefill over a network transport (gloo or NCCL): a 2-rank pair, rebuilt
under a new generation after any failure.

The link makes a random secret (``pdserve.kv.pair_secret``) that it sends only in its own calls to
that prefill: the prefill keys the pair by it, so nobody else can post a send on it, rebuild it or
retire its generations. Its side of each generation's group is built through the prefill's store of
that pair (``RelayStore``: ``PairStore`` calls carrying the secret), never through a shared store.

One fetch, under the link's lock (the puller holds it):
1. make sure there is a usable channel: build the next generation's channel when there is none;
2. PullKvMany for the handles; the receive buffer (room for all of them, back to back) is
   allocated by the link's allocator while the call is out. A prefill that tore this generation
   down answers ABORTED with the lowest generation it takes (before it touches any handle): the link
   moves on and asks once more;
3. post one receive for what the prefill sends (the KVs it holds, concatenated in handle order).
A pull call that failed after the prefill may have posted its send (deadline, lost connection), a
receive buffer that could not be allocated, a size mismatch, or a failed receive closes the
channel: the next fetch builds a new generation, so a receive never takes bytes sent for another
pull and the two sides never fall out of step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import grpc
import torch

from decode_service.metrics import DecodeMetrics
from pdserve.kv.channel import DECODE_RANK, PairChannel, TransferError, transfer_device
from pdserve.kv.handle import MIN_GENERATION_METADATA
from pdserve.kv.pair_secret import MAX_PAIR_GENERATION, new_pair_secret
from pdserve.kv.relay_store import RelayStore
from pdserve.kv.rendezvous import pair_prefix
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

# CUDA receive buffers at least this large are allocated on a worker thread while the pull call is
# out (the caching allocator may call cudaMalloc). A host buffer is allocated on the event loop once
# the request is on its way: one mmap, cheaper than the two thread hops a worker would add.
ALLOCATE_ASIDE_BYTES = 8 << 20

# Pull answers after which the prefill has certainly not posted a send for this pull.
NOTHING_POSTED = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)

Allocator = Callable[[int, torch.device], torch.Tensor]


def allocate(num_bytes: int, device: torch.device) -> torch.Tensor:
    """A receive buffer of ``num_bytes`` on ``device`` (the default allocator of a link)."""
    return torch.empty(num_bytes, dtype=torch.uint8, device=device)


class ReceiveBufferError(TransferError):
    """The receive buffer of a pull could not be allocated; the pair was torn down."""


@dataclass(frozen=True)
class Received:
    """What the prefill sends for one handle: a view of the receive buffer, filled once ``done``."""

    buffer: torch.Tensor
    done: concurrent.futures.Future[None]


class PairLink:
    def __init__(
        self,
        instance_id: str,
        prefill_instance_id: str,
        stub: prefill_pb2_grpc.PrefillStub,
        store_stub: prefill_pb2_grpc.PrefillStub,
        backend: str,
        device: torch.device,
        local_host: str,
        timeout: timedelta,
        metrics: DecodeMetrics,
        receiving: ReceiveCounter,
        allocator: Allocator = allocate,
    ) -> None:
        """``stub`` is the prefill's asyncio stub (pull calls), ``store_stub`` a blocking one (the
        pair store's calls, made from the pair's transfer thread)."""
        self._instance_id = instance_id
        self._prefill_instance_id = prefill_instance_id
        self._stub = stub
        self._store_stub = store_stub
        self._secret = new_pair_secret()
        self._allocator = allocator
        self.backend = backend
        self._device = device
        self._local_host = local_host
        self._timeout = timeout
        self._metrics = metrics
        self._receiving = receiving
        self.generation = 0
        self.channel: PairChannel | None = None

    @property
    def is_open(self) -> bool:
        return self.channel is not None and self.channel.is_usable

    async def fetch(self, handles: Sequence[kv_pb2.KvHandle]) -> list[Received | None]:
        """Per handle, what arrives for it, or None when the prefill does not hold it."""
        channel, sizes, buf = await self._pull_call(handles)
        found = [(h, size) for h, size in zip(handles, sizes, strict=True) if size]
        if any(size != h.num_bytes for h, size in found):
            self.close("size mismatch")  # the prefill sends something else than asked: nothing fits
            raise TransferError(
                f"prefill sends {[s for _, s in found]} bytes, expected {[h.num_bytes for h, _ in found]}"
            )
        if not found:
            return [None] * len(handles)
        done = self._receive(channel, buf.narrow(0, 0, sum(size for _, size in found)))
        out: list[Received | None] = []
        offset = 0
        for size in sizes:
            out.append(Received(buf.narrow(0, offset, size), done) if size else None)
            offset += size
        return out

    def close(self, why: str) -> None:
        if self.channel is not None:
            logger.info(
                "closing KV pair with %s (generation %d): %s", self._prefill_instance_id, self.generation, why
            )
            self.channel.close()
            self.channel = None

    async def _pull_call(
        self, handles: Sequence[kv_pb2.KvHandle]
    ) -> tuple[PairChannel, list[int], torch.Tensor]:
        buf: torch.Tensor | None = None
        num_bytes = sum(h.num_bytes for h in handles)
        for attempt in range(2):
            channel = await self._channel()
            try:
                call = self._stub.PullKvMany(
                    prefill_pb2.PullKvManyRequest(
                        handle_ids=[h.id for h in handles],
                        decode_instance_id=self._instance_id,
                        pair_generation=self.generation,
                        transport=self.backend,
                        pair_secret=self._secret,
                    ),
                    timeout=self._timeout.total_seconds(),
                )
                if buf is None:
                    buf = await self._allocate_or_tear_down(call, num_bytes)
                response = await call
                return channel, list(response.num_bytes), buf
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in NOTHING_POSTED:
                    self.close(f"PullKvMany failed: {exc.code().name}")
                    raise
                minimum = _min_generation(exc)
                if exc.code() != grpc.StatusCode.ABORTED or minimum is None or attempt > 0:
                    raise
                logger.info("prefill retired pair generation %d; moving to %d", self.generation, minimum)
                self.close("generation retired by the prefill")
                self.generation = max(self.generation, minimum - 1)
        raise TransferError("the prefill refused two pair generations in a row")

    async def _channel(self) -> PairChannel:
        if self.channel is not None and self.channel.is_usable:
            return self.channel
        self.close("unusable")
        if self.generation >= MAX_PAIR_GENERATION:  # a new link to the prefill: a new secret
            self._secret, self.generation = new_pair_secret(), 0
        self.generation += 1
        store = RelayStore(self._store_stub, self._instance_id, self._secret, self.generation, self._timeout)
        self.channel = PairChannel(
            store,
            pair_prefix(self._prefill_instance_id, self._instance_id, self.generation),
            DECODE_RANK,
            self.backend,
            self._device,
            self._local_host,
            self._timeout,
        )
        return self.channel

    def _receive(self, channel: PairChannel, buf: torch.Tensor) -> concurrent.futures.Future[None]:
        future = channel.recv(buf)
        self._receiving.add(1)

        def received(f: concurrent.futures.Future[None]) -> None:
            self._receiving.add(-1)
            if f.exception() is not None:
                channel.close()  # broken already: let its thread go now

        future.add_done_callback(received)
        return future

    async def _allocate_or_tear_down(self, call: object, num_bytes: int) -> torch.Tensor:
        """The receive buffer, allocated while the pull call just made is on its way. When it cannot
        be, the call is cancelled and the pair torn down: the prefill may post its send all the
        same, and no later receive on this generation may take those bytes."""
        try:
            return await self._allocate_during(num_bytes)
        except Exception as exc:
            cancel = getattr(call, "cancel", None)
            if cancel is not None:
                cancel()
            self.close("receive buffer could not be allocated")
            raise ReceiveBufferError(f"no receive buffer of {num_bytes} bytes: {exc}") from exc

    async def _allocate_during(self, num_bytes: int) -> torch.Tensor:
        if self.backend == "nccl" and num_bytes >= ALLOCATE_ASIDE_BYTES:
            return await asyncio.to_thread(self._receive_buffer, num_bytes)
        await asyncio.sleep(0)  # lets the call's task send the request first
        return self._receive_buffer(num_bytes)

    def _receive_buffer(self, num_bytes: int) -> torch.Tensor:
        return self._allocator(num_bytes, transfer_device(self.backend, self._device))


class ReceiveCounter:
    """Receives posted and not yet ended, over every link of a decode."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, delta: int) -> None:
        with self._lock:
            self.value += delta


def _min_generation(exc: grpc.aio.AioRpcError) -> int | None:
    for key, value in exc.trailing_metadata() or ():
        if key == MIN_GENERATION_METADATA:
            try:
                return int(value)
            except ValueError:
                return None
    return None
