"""The decode side of the KV handoff: pulls a handle's KV from the prefill that parked it.

Lifecycle of a pull:
1. check the handle against this decode's model (``pdserve.kv.handle``: version, fingerprint,
   backend, layout) before any byte moves; a mismatch is FAILED_PRECONDITION;
2. under the pair's lock: one PullKvMany on the prefill for every pull queued on the pair by then
   (a handle it no longer holds answers 0 bytes: NOT_FOUND for that pull), then one receive posted
   on the pair's channel for what it sends (its KVs as one buffer, in the order of the handles).
   Lock plus shielding keep the order of receives equal to the order of the prefill's sends even if
   the request is cancelled; a burst of requests costs one round trip and one transfer per lock
   holder, not one per request. A prefill that tore this pair's generation down answers ABORTED
   with the lowest generation it takes (before it touches the handles): the pair moves on to it and
   asks once more;
3. wait (bounded) for the data. A pull call that failed after the prefill may have posted its send
   (deadline, lost connection), or a failed receive, closes the channel: the next pull rebuilds
   the pair under a new generation, so the two sides never fall out of step;
4. return views of every layer's keys and values inside the received buffer.

Every wait is bounded by the transfer timeout: connecting to the prefill's store, the pull call
and the receive. Failures on the prefill's side (dead or hung prefill, failed transfer) are
ABORTED: the request can be run again from a new prefill.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from decode_service.metrics import DecodeMetrics
from pdserve.kv.channel import (
    DECODE_RANK,
    PairChannel,
    TransferError,
    transfer_device,
    transfer_threads,
)
from pdserve.kv.handle import MIN_GENERATION_METADATA, HandleCheck
from pdserve.kv.layout import KvLayout, unpack
from pdserve.kv.rendezvous import connect_store, pair_prefix
from pdserve.rpc.errors import RpcError
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

# CUDA receive buffers at least this large are allocated on a worker thread while PullKv is out
# (the caching allocator may call cudaMalloc). A host buffer is allocated on the event loop once
# the request is on its way: one mmap, cheaper than the two thread hops a worker would add.
ALLOCATE_ASIDE_BYTES = 8 << 20

# PullKv answers after which the prefill has certainly not posted a send for this pull.
_NOTHING_POSTED = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ABORTED,
)


@dataclass(frozen=True)
class PulledKv:
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    control_s: float  # compatibility check, PullKv call, receive posted
    data_s: float  # receive posted -> every byte in


@dataclass
class _Pair:
    """This decode's link to one prefill process."""

    prefill_address: str
    rendezvous_address: str
    stub: prefill_pb2_grpc.PrefillStub
    grpc_channel: grpc.aio.Channel
    store: dist.Store | None = None
    generation: int = 0
    channel: PairChannel | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    queue: list[_Wanted] = field(default_factory=list)  # pulls waiting for the lock


@dataclass(eq=False)
class _Wanted:
    """A pull waiting for its pair: the receive, once posted, and its buffer."""

    handle: kv_pb2.KvHandle
    posted: asyncio.Future[tuple[concurrent.futures.Future[None], torch.Tensor]]


class KvPuller:
    def __init__(
        self,
        instance_id: str,
        fingerprint: str,
        layout: KvLayout,
        backend: str,
        device: torch.device,
        local_host: str,
        timeout: timedelta,
        metrics: DecodeMetrics,
    ) -> None:
        self._instance_id = instance_id
        self._fingerprint = fingerprint
        self._layout = layout
        self._backend = backend
        self._device = device
        self._local_host = local_host
        self._timeout = timeout
        self._metrics = metrics
        self._pairs: dict[str, _Pair] = {}
        self._check = HandleCheck(fingerprint, backend, layout)
        self._receiving = 0
        self._receiving_lock = threading.Lock()
        metrics.kv_pairs.set_function(lambda: self.num_pairs)
        metrics.kv_receives_in_flight.set_function(lambda: self._receiving)
        metrics.kv_transfer_threads.set_function(transfer_threads)

    @property
    def num_pairs(self) -> int:
        """Pairs with a usable channel (one per prefill this decode pulls from)."""
        return sum(1 for p in list(self._pairs.values()) if p.channel is not None and p.channel.is_usable)

    @property
    def num_receiving(self) -> int:
        return self._receiving

    def check_compatible(self, handle: kv_pb2.KvHandle) -> None:
        """Raises RpcError(FAILED_PRECONDITION) when this decode cannot use the handle's KV."""
        problem = self._check.problem(handle)
        if problem is not None:
            self._metrics.kv_refused.inc()
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, problem)

    async def pull(self, handle: kv_pb2.KvHandle) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The handle's KV as per-layer (keys, values) views ``[heads, T, width]``."""
        return (await self.pull_timed(handle)).layers

    async def pull_timed(self, handle: kv_pb2.KvHandle) -> PulledKv:
        """``pull``, with the time spent in control (RPC) and in data (the receive)."""
        started = time.perf_counter()
        self.check_compatible(handle)
        # Shielded: once PullKv may have posted the prefill's send, the receive must be posted too.
        posted = asyncio.ensure_future(self._post(handle))
        try:
            future, buf = await asyncio.shield(posted)
            control_done = time.perf_counter()
            await asyncio.wrap_future(future)
        except RpcError:
            self._metrics.kv_pull_failures.inc()
            raise
        except TransferError as exc:
            self._metrics.kv_pull_failures.inc()
            raise RpcError(
                grpc.StatusCode.ABORTED, f"KV transfer from prefill {handle.prefill_address} failed: {exc}"
            ) from exc
        except grpc.aio.AioRpcError as exc:
            self._metrics.kv_pull_failures.inc()
            code = exc.code()
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise RpcError(code, f"PullKv on {handle.prefill_address}: {exc.details()}") from exc
            raise RpcError(
                grpc.StatusCode.ABORTED,
                f"PullKv on prefill {handle.prefill_address} failed ({code.name}: {exc.details()})",
            ) from exc
        data_done = time.perf_counter()
        self._metrics.kv_pulls.inc()
        self._metrics.kv_received_bytes.inc(handle.num_bytes)
        self._metrics.kv_pull_seconds.observe(data_done - started)
        layers = unpack(buf, self._layout, handle.num_tokens)
        return PulledKv(layers, control_done - started, data_done - control_done)

    async def _post(self, handle: kv_pb2.KvHandle) -> tuple[concurrent.futures.Future[None], torch.Tensor]:
        """The handle's pull call, then its receive posted into a new buffer. Pulls that queue on the
        pair while another holds its lock go together in one PullKvMany, once the lock is free."""
        pair = self._pair(handle)
        wanted = _Wanted(handle, asyncio.get_running_loop().create_future())
        pair.queue.append(wanted)
        async with pair.lock:
            if not wanted.posted.done():  # nobody took it along: take every pull queued by now
                batch, pair.queue = pair.queue, []
                await self._post_batch(pair, batch)
        return wanted.posted.result()

    async def _post_batch(self, pair: _Pair, batch: list[_Wanted]) -> None:
        """One pull call for ``batch`` (under the pair's lock); each pull's outcome goes to its future."""
        try:
            channel, sizes, buf = await self._pull_call(pair, [w.handle for w in batch])
        except asyncio.CancelledError:
            for w in batch:
                w.posted.cancel()
            raise
        except Exception as exc:
            for w in batch:
                w.posted.set_exception(exc)
            return
        found = [(w, size) for w, size in zip(batch, sizes, strict=True) if size]
        for w, size in zip(batch, sizes, strict=True):
            if size == 0:
                w.posted.set_exception(
                    RpcError(
                        grpc.StatusCode.NOT_FOUND,
                        f"PullKvMany on {pair.prefill_address}: KV handle is unknown, expired or already pulled",
                    )
                )
        if not found:
            return
        if any(size != w.handle.num_bytes for w, size in found):
            # The prefill sends something else than what was asked: nothing can be received.
            self._break(pair, "size mismatch")
            broken = TransferError(
                f"prefill sends {[size for _, size in found]} bytes, expected {[w.handle.num_bytes for w, _ in found]}"
            )
            for w, _ in found:
                w.posted.set_exception(broken)
            return
        total = sum(size for _, size in found)
        future = self._receive(channel, buf.narrow(0, 0, total))
        offset = 0
        for w, size in found:
            w.posted.set_result((future, buf.narrow(0, offset, size)))
            offset += size

    async def _pull_call(
        self, pair: _Pair, handles: Sequence[kv_pb2.KvHandle]
    ) -> tuple[PairChannel, list[int], torch.Tensor]:
        """One PullKvMany for ``handles`` on the pair's channel; the receive buffer (room for every
        handle's KV, back to back) is allocated while the call is out. Returns the channel, what the
        prefill sends for each handle (0: not parked there, nothing sent) and the buffer."""
        buf: torch.Tensor | None = None
        num_bytes = sum(h.num_bytes for h in handles)
        for attempt in range(2):
            channel = await self._channel(pair, handles[0])
            timeout = self._timeout.total_seconds()
            try:
                call = pair.stub.PullKvMany(
                    prefill_pb2.PullKvManyRequest(
                        handle_ids=[h.id for h in handles],
                        decode_instance_id=self._instance_id,
                        pair_generation=pair.generation,
                    ),
                    timeout=timeout,
                )
                buf = buf if buf is not None else await self._allocate_during(num_bytes)
                response = await call
                return channel, list(response.num_bytes), buf
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _NOTHING_POSTED:
                    self._break(pair, f"PullKv failed: {exc.code().name}")
                    raise
                minimum = _min_generation(exc)
                if exc.code() != grpc.StatusCode.ABORTED or minimum is None or attempt > 0:
                    raise
                logger.info(
                    "prefill %s retired pair generation %d; moving to %d",
                    pair.prefill_address,
                    pair.generation,
                    minimum,
                )
                self._break(pair, "generation retired by the prefill")
                pair.generation = max(pair.generation, minimum - 1)
        raise AssertionError("unreachable")

    def _receive(self, channel: PairChannel, buf: torch.Tensor) -> concurrent.futures.Future[None]:
        future = channel.recv(buf)
        with self._receiving_lock:
            self._receiving += 1
        future.add_done_callback(lambda f: self._received(channel, f))
        return future

    async def _allocate_during(self, num_bytes: int) -> torch.Tensor:
        """A receive buffer, allocated while the PullKv call just made is on its way."""
        if self._backend == "nccl" and num_bytes >= ALLOCATE_ASIDE_BYTES:
            return await asyncio.to_thread(self._receive_buffer, num_bytes)
        await asyncio.sleep(0)  # lets the call's task send the request first
        return self._receive_buffer(num_bytes)

    def _receive_buffer(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, device=transfer_device(self._backend, self._device))

    def _received(self, channel: PairChannel, future: concurrent.futures.Future[None]) -> None:
        with self._receiving_lock:
            self._receiving -= 1
        if future.exception() is not None:
            channel.close()  # broken already: let its thread go now

    async def _channel(self, pair: _Pair, handle: kv_pb2.KvHandle) -> PairChannel:
        """The pair's usable channel; a new generation when there is none (under the pair's lock)."""
        if pair.channel is not None and pair.channel.is_usable:
            return pair.channel
        if pair.channel is not None:
            pair.channel.close()
        if pair.store is None:
            try:
                pair.store = await asyncio.to_thread(connect_store, pair.rendezvous_address, self._timeout)
            except Exception as exc:
                raise TransferError(f"cannot reach the KV store {pair.rendezvous_address}: {exc}") from exc
        pair.generation += 1
        pair.channel = PairChannel(
            pair.store,
            pair_prefix(handle.prefill_instance_id, self._instance_id, pair.generation),
            DECODE_RANK,
            self._backend,
            self._device,
            self._local_host,
            self._timeout,
        )
        return pair.channel

    def _break(self, pair: _Pair, why: str) -> None:
        if pair.channel is not None:
            logger.info(
                "closing KV pair with %s (generation %d): %s", pair.prefill_address, pair.generation, why
            )
            pair.channel.close()
            pair.channel = None

    def _pair(self, handle: kv_pb2.KvHandle) -> _Pair:
        pair = self._pairs.get(handle.prefill_instance_id)
        if pair is None:
            grpc_channel = grpc.aio.insecure_channel(handle.prefill_address)
            pair = _Pair(
                prefill_address=handle.prefill_address,
                rendezvous_address=handle.rendezvous_address,
                stub=prefill_pb2_grpc.PrefillStub(grpc_channel),
                grpc_channel=grpc_channel,
            )
            self._pairs[handle.prefill_instance_id] = pair
        return pair

    async def close(self) -> None:
        for pair in self._pairs.values():
            if pair.channel is not None:
                pair.channel.close()
            await pair.grpc_channel.close()
        self._pairs.clear()


def _min_generation(exc: grpc.aio.AioRpcError) -> int | None:
    for key, value in exc.trailing_metadata() or ():
        if key == MIN_GENERATION_METADATA:
            try:
                return int(value)
            except ValueError:
                return None
    return None
