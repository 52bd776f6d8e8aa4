"""A decode's link to one prefill over a network transport (gloo or NCCL): a 2-rank pair, rebuilt
under a new generation after any failure.

One fetch, under the link's lock (the puller holds it):
1. make sure there is a usable channel: connect to the prefill's rendezvous store once, then build
   the next generation's channel when there is none;
2. PullKvMany for the handles; the receive buffer (room for all of them, back to back) is
   allocated while the call is out. A prefill that tore this generation down answers ABORTED with
   the lowest generation it takes (before it touches any handle): the link moves on and asks once
   more;
3. post one receive for what the prefill sends (the KVs it holds, concatenated in handle order).
A pull call that failed after the prefill may have posted its send (deadline, lost connection), a
size mismatch, or a failed receive closes the channel: the next fetch builds a new generation, so
the two sides never fall out of step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from decode_service.metrics import DecodeMetrics
from pdserve.kv.channel import DECODE_RANK, PairChannel, TransferError, transfer_device
from pdserve.kv.handle import MIN_GENERATION_METADATA
from pdserve.kv.rendezvous import connect_store, pair_prefix
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

# CUDA receive buffers at least this large are allocated on a worker thread while the pull call is
# out (the caching allocator may call cudaMalloc). A host buffer is allocated on the event loop once
# the request is on its way: one mmap, cheaper than the two thread hops a worker would add.
ALLOCATE_ASIDE_BYTES = 8 << 20

# Pull answers after which the prefill has certainly not posted a send for this pull.
NOTHING_POSTED = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ABORTED)


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
        rendezvous_address: str,
        stub: prefill_pb2_grpc.PrefillStub,
        backend: str,
        device: torch.device,
        local_host: str,
        timeout: timedelta,
        metrics: DecodeMetrics,
        receiving: ReceiveCounter,
    ) -> None:
        self._instance_id = instance_id
        self._prefill_instance_id = prefill_instance_id
        self._rendezvous_address = rendezvous_address
        self._stub = stub
        self.backend = backend
        self._device = device
        self._local_host = local_host
        self._timeout = timeout
        self._metrics = metrics
        self._receiving = receiving
        self._store: dist.Store | None = None
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
                    ),
                    timeout=self._timeout.total_seconds(),
                )
                buf = buf if buf is not None else await self._allocate_during(num_bytes)
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
        if self._store is None:
            try:
                self._store = await asyncio.to_thread(connect_store, self._rendezvous_address, self._timeout)
            except Exception as exc:
                raise TransferError(f"cannot reach the KV store {self._rendezvous_address}: {exc}") from exc
        self.generation += 1
        self.channel = PairChannel(
            self._store,
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

    async def _allocate_during(self, num_bytes: int) -> torch.Tensor:
        """A receive buffer, allocated while the pull call just made is on its way."""
        if self.backend == "nccl" and num_bytes >= ALLOCATE_ASIDE_BYTES:
            return await asyncio.to_thread(self._receive_buffer, num_bytes)
        await asyncio.sleep(0)  # lets the call's task send the request first
        return self._receive_buffer(num_bytes)

    def _receive_buffer(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, device=transfer_device(self.backend, self._device))


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
