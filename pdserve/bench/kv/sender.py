"""The prefill side (rank 0) of ``pdserve bench-kv``: packs, copies and moves each size over the
transport measured, serves the pull calls, and gathers what the decode side measured (see
``pdserve.bench.kv.command``)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import statistics
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import torch
from prometheus_client import CollectorRegistry

from pdserve.bench.kv.config import BenchKvConfig
from pdserve.bench.kv.peer import (
    DIGEST_METADATA,
    FINGERPRINT,
    HANDOFF_METHOD,
    RAW_PREFIX,
    Clock,
    digest,
    run_peer,
    store_get,
    store_set,
    transfer_backend,
)
from pdserve.config.security import new_token
from pdserve.kv import cuda_ipc
from pdserve.kv.channel import PREFILL_RANK, PairChannel, transfer_device
from pdserve.kv.handle import HandleIssuer
from pdserve.kv.layout import pack, unpack
from pdserve.kv.rendezvous import host_store
from pdserve.kv.shared_memory import InstanceLock, SharedArena, host_id, is_alive
from pdserve.kv.transports import NETWORK, SAME_HOST, SHM
from pdserve.rpc.channel_security import INTERNAL_TOKEN_KEY, ChannelSecurity
from pdserve.rpc.metadata_gate import MetadataGate
from pdserve.rpc.service_security import INTERNAL_REFUSAL
from pdserve.v1 import kv_pb2, prefill_pb2_grpc
from prefill_service.kv_lender import KvLender
from prefill_service.kv_registry import KvRegistry
from prefill_service.kv_sender import KvSender
from prefill_service.kv_space import KvSpace
from prefill_service.metrics import PrefillMetrics
from prefill_service.servicer import KvHandoffServicer


async def run(config: BenchKvConfig, emit: Callable[[dict[str, Any]], None]) -> None:
    """Runs every size and calls ``emit`` with one result per size."""
    torch.set_num_threads(config.threads)
    backend = config.backend_name
    device = torch.device(config.device)
    timeout = timedelta(seconds=config.timeout_s)
    store = host_store(config.host, 0, timeout)
    rendezvous = f"{config.host}:{store.port}"
    metrics = PrefillMetrics(CollectorRegistry())
    registry = KvRegistry(config.timeout_s)
    instance_id = uuid.uuid4().hex
    shm_dir = Path(config.shm_dir)
    lock = InstanceLock(shm_dir, instance_id) if backend == SHM else None
    largest = max(map(config.layout().num_bytes, config.token_counts))
    arena = SharedArena(shm_dir, instance_id, 3 * largest + (1 << 20)) if lock else None
    place = cuda_ipc.place_of(device, host_id(shm_dir) if backend in SAME_HOST else "")
    space = KvSpace(backend, place, device, arena)
    lender = KvLender(partial(is_alive, shm_dir))
    sender = KvSender(instance_id, transfer_backend(backend), device, config.host, timeout, metrics)
    # Like a prefill, its Prefill service takes only calls with the run's internal token.
    token = new_token()
    security = ChannelSecurity(((INTERNAL_TOKEN_KEY, token),))
    server = grpc.aio.server(interceptors=[MetadataGate(INTERNAL_TOKEN_KEY, token, INTERNAL_REFUSAL)])
    servicer = KvHandoffServicer(registry, sender, metrics, lender)
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{config.host}:0")
    await server.start()
    template = HandleIssuer(
        prefill_address=f"{config.host}:{port}",
        prefill_instance_id=instance_id,
        model_fingerprint=FINGERPRINT,
        layout=config.layout(),
        place=place,
    )
    peer = multiprocessing.get_context("spawn").Process(
        target=run_peer, args=(config, rendezvous, token), name="bench-kv-decode", daemon=True
    )
    peer.start()
    raw = None
    if backend in NETWORK:
        raw = PairChannel(store, RAW_PREFIX, PREFILL_RANK, backend, device, config.host, timeout)
    peer_channel = security.aio_channel((await store_get(store, "peer/address")).decode())
    handoff = peer_channel.unary_unary(
        HANDOFF_METHOD, request_serializer=kv_pb2.KvHandle.SerializeToString, response_deserializer=json.loads
    )
    try:
        for num_tokens in config.token_counts:
            emit(await _measure(_Sizes(config, store, raw, space, registry, template, handoff), num_tokens))
        await store_set(store, "finished", "1")
    finally:
        if raw is not None:
            raw.close()
        sender.close()
        await peer_channel.close()
        await server.stop(0)
        peer.join(config.timeout_s)
        if peer.is_alive():
            peer.kill()
        lender.close()
        space.close()
        if lock is not None:
            lock.release()


@dataclass
class _Sizes:
    """What one size's measurement needs: the transport's ends, the prefill's parts and a clock."""

    config: BenchKvConfig
    store: Any
    raw: PairChannel | None  # None: the transport reads in place (shm, cuda-ipc)
    space: KvSpace
    registry: KvRegistry
    template: HandleIssuer
    handoff: Any

    @property
    def clock(self) -> Clock:
        return Clock(torch.device(self.config.device))


def _median(values: list[float]) -> float:
    return statistics.median(values[1:])  # the first run warms up


async def _measure(run: _Sizes, num_tokens: int) -> dict[str, Any]:
    config = run.config
    layout = config.layout()
    buf, pack_s = _packed(config, num_tokens)
    memcpy = _median(_memcpy_s(run, buf))
    sent_raw = digest([buf])
    sent_kv = digest([t for kv in unpack(buf, layout, num_tokens) for t in kv])
    transfer_s, peer_memcpy_s, received_raw = await _raw_s(run, num_tokens, buf)
    hop_s, control_s, data_s, received_kv = await _handoff_s(run, num_tokens, buf)
    transfer, hop, control, data = map(_median, (transfer_s, hop_s, control_s, data_s))
    num_bytes = buf.numel()
    return {
        "tokens": num_tokens,
        "bytes": num_bytes,
        "mib": num_bytes / 2**20,
        "memcpy_gbps": num_bytes / memcpy / 1e9,
        "transfer_gbps": num_bytes / transfer / 1e9,
        "transfer_to_memcpy": memcpy / transfer,
        "peer_memcpy_gbps": num_bytes / _median(peer_memcpy_s) / 1e9,
        "transfer_to_peer_memcpy": _median([m / t for m, t in zip(peer_memcpy_s, transfer_s, strict=True)]),
        "pack_ms": pack_s * 1e3,
        "hop_ms": hop * 1e3,
        "control_ms": control * 1e3,
        "data_ms": data * 1e3,
        "handoff_ms": (pack_s + 2 * hop + control + data) * 1e3,
        "handoff_gbps": num_bytes / data / 1e9,
        "intact": received_raw == sent_raw and received_kv == sent_kv,
        "backend": config.backend_name,
        "device": config.device,
        "peer_device": config.receiver_device,
        "repeat": config.repeat,
        "threads": config.threads,
    }


def _packed(config: BenchKvConfig, num_tokens: int) -> tuple[torch.Tensor, float]:
    """A random cache of ``num_tokens`` packed as a prefill packs one, and the time packing took."""
    clock = Clock(torch.device(config.device))
    target = transfer_device(transfer_backend(config.backend_name), torch.device(config.device))
    generator = torch.Generator(device=config.device).manual_seed(num_tokens)
    shape = (1, config.kv_heads, num_tokens, config.head_dim)

    def random_half() -> torch.Tensor:
        values = torch.rand(shape, generator=generator, device=config.device, dtype=torch.float32)
        return values.to(config.torch_dtype)

    layers = [(random_half(), random_half()) for _ in range(config.layers)]
    start = clock.now()
    buf = pack(layers, config.layout(), 0, 0, num_tokens, target)
    return buf, clock.now() - start


def _memcpy_s(run: _Sizes, buf: torch.Tensor) -> list[float]:
    """Same-process copies of ``buf`` into a warm buffer."""
    dst = torch.empty_like(buf)
    times = []
    for _ in range(run.config.repeat + 1):
        start = run.clock.now()
        dst.copy_(buf)
        times.append(run.clock.now() - start)
    return times


async def _raw_s(run: _Sizes, num_tokens: int, buf: torch.Tensor) -> tuple[list[float], list[float], str]:
    """``buf`` into the decode's warm buffer over the transport: sent over the raw pair, or copied
    out of the prefill's memory where it lies. Returns the times, the decode's local copy of as
    many bytes timed right before each one, and the digest that arrived."""
    shared = run.space.allocate(buf.numel()) if run.raw is None else None
    where: dict[str, Any] = {"bytes": buf.numel()}
    if shared is not None:
        shared.tensor.copy_(buf)
        if shared.arena_offset is not None:
            where.update(offset=shared.arena_offset, instance=run.template.prefill_instance_id)
        else:
            where["ipc"] = cuda_ipc.export(shared.tensor).SerializeToString().hex()
    await store_set(run.store, f"size/{num_tokens}", json.dumps(where))
    times, memcpys = [], []
    for i in range(run.config.repeat + 1):
        await store_get(run.store, f"raw/{num_tokens}/{i}/posted")
        memcpys.append(float(await store_get(run.store, f"raw/{num_tokens}/{i}/memcpy")))
        if run.raw is not None:
            start = run.clock.now()
            await asyncio.wrap_future(run.raw.send(buf))
            times.append(float(await store_get(run.store, f"raw/{num_tokens}/{i}/done")) - start)
        else:  # read in place: the decode's one copy out of the prefill's memory
            times.append(float(await store_get(run.store, f"raw/{num_tokens}/{i}/took")))
    received = (await store_get(run.store, f"raw/{num_tokens}/digest")).decode()
    if shared is not None:
        shared.free()
    return times, memcpys, received


async def _handoff_s(
    run: _Sizes, num_tokens: int, buf: torch.Tensor
) -> tuple[list[float], list[float], list[float], str]:
    """Parked KVs handed to the decode through the real path: hop, control and data times, and the
    digest of the last one as the decode received it."""
    hop_s, control_s, data_s = [], [], []
    received = ""
    for i in range(run.config.repeat + 1):
        parked = run.space.allocate(buf.numel())
        parked.tensor.copy_(buf)
        handle = run.template.issue(run.registry.park(parked, num_tokens))
        last = i == run.config.repeat
        sent_at = run.clock.now()
        timed = await run.handoff(handle, metadata=((DIGEST_METADATA, "1"),) if last else None)
        hop_s.append(timed["received_at"] - sent_at)
        control_s.append(timed["control_s"])
        data_s.append(timed["data_s"])
        if last:
            received = timed["digest"]
    return hop_s, control_s, data_s, received
