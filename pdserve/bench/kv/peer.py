"""The decode side (rank 1) of ``pdserve bench-kv``, run in a process of its own.

For each size it moves the bytes into a warm buffer over the transport measured, driven through the
rendezvous store: received over the raw PairChannel (gloo, NCCL), or copied out of the prefill's
memory where it lies (shm, cuda-ipc: the one copy a decode makes). It serves one gRPC method,
``Handoff``, which carries a KV handle to it as the gateway's decode call carries one to a decode:
it pulls the handle through a real ``KvPuller`` (PullKvMany over gRPC; a fresh buffer per pull
over a pair, or the KV read in place and copied into a warm buffer as into a pool) and answers
when the call arrived and the puller's control and data times, plus, when asked, a digest of what
arrived.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import torch
from prometheus_client import CollectorRegistry

from decode_service.kv_puller import KvPuller
from decode_service.metrics import DecodeMetrics
from pdserve.bench.kv.config import BenchKvConfig
from pdserve.kv import cuda_ipc
from pdserve.kv.channel import DECODE_RANK, PairChannel, transfer_device
from pdserve.kv.rendezvous import connect_store
from pdserve.kv.shared_memory import ArenaReader, host_id
from pdserve.kv.transports import NETWORK, SAME_HOST
from pdserve.rpc.channel_security import INTERNAL_TOKEN_KEY, ChannelSecurity
from pdserve.rpc.metadata_gate import MetadataGate
from pdserve.rpc.server import event_loop_factory
from pdserve.rpc.service_security import INTERNAL_REFUSAL
from pdserve.v1 import kv_pb2

FINGERPRINT = "pdserve-bench-kv"
RAW_PREFIX = "pdserve/bench-kv/raw/"
HANDOFF_METHOD = "/pdserve.bench.v1.BenchKv/Handoff"
DIGEST_METADATA = "pdserve-bench-digest"


class Clock:
    """Seconds on CLOCK_MONOTONIC, which every process of one host shares, after the device's work."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.clock_gettime(time.CLOCK_MONOTONIC)


def digest(tensors: Sequence[torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().data)
    return h.hexdigest()


def run_peer(config: BenchKvConfig, rendezvous: str, token: str) -> None:
    """The decode side; ``token``: the run's internal token (its calls carry it, its server wants it)."""
    torch.set_num_threads(config.threads)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # the services' event loop
        runner.run(_serve(config, rendezvous, token))


def transfer_backend(backend: str) -> str:
    """The pair backend of the raw path and of the sender: the transport itself over a network."""
    return backend if backend in NETWORK else "gloo"


async def _serve(config: BenchKvConfig, rendezvous: str, token: str) -> None:
    backend = config.backend_name
    device = torch.device(config.receiver_device)
    timeout = timedelta(seconds=config.timeout_s)
    store = connect_store(rendezvous, timeout)
    raw = None
    if backend in NETWORK:
        raw = PairChannel(store, RAW_PREFIX, DECODE_RANK, backend, device, config.host, timeout)
    shm_dir = Path(config.shm_dir)
    puller = KvPuller(
        uuid.uuid4().hex,
        FINGERPRINT,
        config.layout(),
        backend,
        device,
        config.host,
        timeout,
        DecodeMetrics(CollectorRegistry()),
        place=cuda_ipc.place_of(device, host_id(shm_dir) if backend in SAME_HOST else ""),
        shm_dir=str(shm_dir),
        security=ChannelSecurity(((INTERNAL_TOKEN_KEY, token),)),
    )
    server = grpc.aio.server(interceptors=[MetadataGate(INTERNAL_TOKEN_KEY, token, INTERNAL_REFUSAL)])
    handler = grpc.unary_unary_rpc_method_handler(
        _Handoff(puller, Clock(device)).handle,
        request_deserializer=kv_pb2.KvHandle.FromString,
        response_serializer=lambda b: b,
    )
    service, method = HANDOFF_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {method: handler})])
    port = server.add_insecure_port(f"{config.host}:0")
    await server.start()
    await store_set(store, "peer/address", f"{config.host}:{port}")
    try:
        for num_tokens in config.token_counts:
            await _receive_raw(config, store, raw, shm_dir, num_tokens, Clock(device))
        await store_get(store, "finished")
    finally:
        if raw is not None:
            raw.close()
        await server.stop(0)
        await puller.close()


class _Handoff:
    """The ``Handoff`` method: a handle pulled through the real puller, as a decode takes one."""

    def __init__(self, puller: KvPuller, clock: Clock) -> None:
        self._puller = puller
        self._clock = clock
        self._pools: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    async def handle(self, handle: kv_pb2.KvHandle, context: Any) -> bytes:
        received_at = self._clock.now()
        pulled = await self._puller.pull_timed(handle)
        data_s = pulled.data_s
        layers = pulled.layers
        if pulled.transport in SAME_HOST:  # read in place: the decode copies it into its pool once
            data_s, layers = self._copy_into_pool(handle.num_tokens, layers)
            pulled.release()
        answer: dict[str, Any] = {"received_at": received_at, "control_s": pulled.control_s, "data_s": data_s}
        if any(key == DIGEST_METADATA for key, _ in context.invocation_metadata()):
            answer["digest"] = digest([t for kv in layers for t in kv])
        del pulled, layers  # the buffer is freed before the answer, outside the next handoff's times
        return json.dumps(answer).encode()

    def _copy_into_pool(
        self, num_tokens: int, layers: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]:
        pool = self._pools.get(num_tokens)
        if pool is None:
            pool = self._pools[num_tokens] = [(k.clone(), v.clone()) for k, v in layers]
        start = self._clock.now()
        for (k, v), (pk, pv) in zip(layers, pool, strict=True):
            pk.copy_(k)
            pv.copy_(v)
        return self._clock.now() - start, pool


async def _receive_raw(
    config: BenchKvConfig, store: Any, raw: PairChannel | None, shm_dir: Path, num_tokens: int, clock: Clock
) -> None:
    """One size into a warm buffer, each run timed and preceded by a timed local copy of as many
    bytes: received over the raw pair, or copied out of the prefill's memory where it lies; then
    the digest of what arrived."""
    size = json.loads(await store_get(store, f"size/{num_tokens}"))
    device = torch.device(config.receiver_device)
    target = transfer_device(transfer_backend(config.backend_name), device) if raw is not None else device
    warm = torch.empty(size["bytes"], dtype=torch.uint8, device=target)
    source = _lent_source(size, shm_dir, config) if raw is None else None
    scratch = torch.empty_like(warm)
    for i in range(config.repeat + 1):
        # The same bytes copied within this process right before each transfer: a memcpy taken
        # under the load of that moment, which the transfer is compared with.
        start = clock.now()
        scratch.copy_(warm)
        await store_set(store, f"raw/{num_tokens}/{i}/memcpy", str(clock.now() - start))
        if raw is not None:
            future: concurrent.futures.Future[None] = raw.recv(warm)
            await store_set(store, f"raw/{num_tokens}/{i}/posted", "1")
            await asyncio.wrap_future(future)
            await store_set(store, f"raw/{num_tokens}/{i}/done", str(clock.now()))
        elif source is not None:
            await store_set(store, f"raw/{num_tokens}/{i}/posted", "1")
            start = clock.now()
            warm.copy_(source)
            await store_set(store, f"raw/{num_tokens}/{i}/took", str(clock.now() - start))
    await store_set(store, f"raw/{num_tokens}/digest", digest([warm]))


def _lent_source(size: dict[str, Any], shm_dir: Path, config: BenchKvConfig) -> torch.Tensor:
    """The prefill's buffer, read in place: a region of its arena, or its exported GPU memory."""
    if "offset" in size:
        return ArenaReader(shm_dir, size["instance"]).region(int(size["offset"]), int(size["bytes"]))
    message = kv_pb2.CudaIpcBuffer.FromString(bytes.fromhex(size["ipc"]))
    return cuda_ipc.open_buffer(message, torch.device(config.device).index or 0)


async def store_set(store: Any, key: str, value: str | bytes) -> None:
    """``store.set`` off the event loop (both sides of the benchmark use the rendezvous store)."""
    await asyncio.to_thread(store.set, key, value)


async def store_get(store: Any, key: str) -> bytes:
    """``store.get`` off the event loop: waits for ``key`` up to the store's timeout."""
    value: bytes = await asyncio.to_thread(store.get, key)
    return value
