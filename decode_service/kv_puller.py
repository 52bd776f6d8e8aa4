"""The decode side of the KV handoff: pulls a handle's KV from the prefill that parked it.

Lifecycle of a pull:
1. check the handle against this decode's model (fingerprint, backend, layout) before any byte
   moves; a mismatch is FAILED_PRECONDITION;
2. under the pair's lock: call PullKv on the prefill (NOT_FOUND when the handle is unknown or
   expired) and post the receive on the pair's channel. Lock plus shielding keep the order of
   receives equal to the order of the prefill's sends even if the request is cancelled;
3. wait (bounded) for the data; a failure breaks the channel and the next pull rebuilds the pair
   under a new generation;
4. return views of every layer's keys and values inside the received buffer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import torch
import torch.distributed as dist

from decode_service.metrics import DecodeMetrics
from pdserve.kv_layout import KvLayout, spec_from_proto, unpack
from pdserve.kv_transport import (
    DECODE_RANK,
    PairChannel,
    TransferError,
    connect_store,
    pair_prefix,
    transfer_device,
)
from pdserve.rpc_errors import RpcError
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)


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

    def check_compatible(self, handle: kv_pb2.KvHandle) -> None:
        """Raises RpcError(FAILED_PRECONDITION) when this decode cannot use the handle's KV."""
        problem = None
        if handle.model_fingerprint != self._fingerprint:
            problem = (
                f"model fingerprint {handle.model_fingerprint!r} differs from this decode's "
                f"{self._fingerprint!r}"
            )
        elif handle.backend != self._backend:
            problem = f"KV backend {handle.backend!r} differs from this decode's {self._backend!r}"
        elif handle.num_tokens < 1:
            problem = "KV handle holds no tokens"
        else:
            try:
                theirs = [spec_from_proto(t) for t in handle.tensors]
            except ValueError as exc:
                theirs = []
                problem = str(exc)
            ours = self._layout.tensor_specs(handle.num_tokens)
            if problem is None and theirs != ours:
                problem = "KV layout (tensor names, shapes or dtypes) differs from this decode's model"
            elif problem is None and handle.num_bytes != self._layout.num_bytes(handle.num_tokens):
                expected = self._layout.num_bytes(handle.num_tokens)
                problem = f"KV size {handle.num_bytes} differs from the {expected} expected"
        if problem is not None:
            self._metrics.kv_refused.inc()
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, problem)

    async def pull(self, handle: kv_pb2.KvHandle) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The handle's KV as per-layer (keys, values) views ``[heads, T, width]``."""
        self.check_compatible(handle)
        started = time.perf_counter()
        buf = torch.empty(
            handle.num_bytes, dtype=torch.uint8, device=transfer_device(self._backend, self._device)
        )
        # Shielded: once PullKv may have posted the prefill's send, the receive must be posted too.
        posted = asyncio.ensure_future(self._post(handle, buf))
        try:
            future = await asyncio.shield(posted)
            await asyncio.wrap_future(future)
        except TransferError as exc:
            self._metrics.kv_pull_failures.inc()
            raise RpcError(
                grpc.StatusCode.UNAVAILABLE, f"KV transfer from {handle.prefill_address} failed: {exc}"
            ) from exc
        except grpc.aio.AioRpcError as exc:
            self._metrics.kv_pull_failures.inc()
            code = exc.code()
            if code not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                code = grpc.StatusCode.UNAVAILABLE
            raise RpcError(code, f"PullKv on {handle.prefill_address}: {exc.details()}") from exc
        self._metrics.kv_pulls.inc()
        self._metrics.kv_received_bytes.inc(handle.num_bytes)
        self._metrics.kv_pull_seconds.observe(time.perf_counter() - started)
        return unpack(buf, self._layout, handle.num_tokens)

    async def _post(self, handle: kv_pb2.KvHandle, buf: torch.Tensor) -> concurrent.futures.Future[None]:
        pair = self._pair(handle)
        async with pair.lock:
            if pair.store is None:
                pair.store = await asyncio.to_thread(connect_store, pair.rendezvous_address, self._timeout)
            if pair.channel is None or not pair.channel.is_usable:
                if pair.channel is not None:
                    pair.channel.close()
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
            request = prefill_pb2.PullKvRequest(
                handle_id=handle.id, decode_instance_id=self._instance_id, pair_generation=pair.generation
            )
            response = await pair.stub.PullKv(request, timeout=self._timeout.total_seconds())
            if response.num_bytes != buf.numel():
                pair.channel.close()  # the prefill posted a send of another size: this pair is out of step
                raise TransferError(f"prefill sends {response.num_bytes} bytes, expected {buf.numel()}")
            return pair.channel.recv(buf)

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
