"""The prefill side (rank 0) of ``pdserve bench-kv``: packs, copies and sends each size, serves
PullKv, and gathers what the decode side measured (see ``pdserve.bench.kv.command``)."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import statistics
import uuid
from collections.abc import Callable
from datetime import timedelta
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
)
from pdserve.kv.channel import PREFILL_RANK, PairChannel, transfer_device
from pdserve.kv.handle import HandleIssuer
from pdserve.kv.layout import pack, unpack
from pdserve.kv.rendezvous import host_store
from pdserve.v1 import kv_pb2, prefill_pb2_grpc
from prefill_service.kv_registry import KvRegistry
from prefill_service.kv_sender import KvSender
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
    sender = KvSender(instance_id, store, backend, device, config.host, timeout, metrics)
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServicer_to_server(KvHandoffServicer(registry, sender, metrics), server)
    port = server.add_insecure_port(f"{config.host}:0")
    await server.start()
    template = HandleIssuer(
        prefill_address=f"{config.host}:{port}",
        prefill_instance_id=instance_id,
        rendezvous_address=rendezvous,
        backend=backend,
        model_fingerprint=FINGERPRINT,
        layout=config.layout(),
    )
    peer = multiprocessing.get_context("spawn").Process(
        target=run_peer, args=(config, rendezvous), name="bench-kv-decode", daemon=True
    )
    peer.start()
    raw = PairChannel(store, RAW_PREFIX, PREFILL_RANK, backend, device, config.host, timeout)
    peer_channel = grpc.aio.insecure_channel((await _get(store, "peer/address")).decode())
    handoff = peer_channel.unary_unary(
        HANDOFF_METHOD, request_serializer=kv_pb2.KvHandle.SerializeToString, response_deserializer=json.loads
    )
    try:
        for num_tokens in config.token_counts:
            emit(await _measure(config, num_tokens, store, raw, registry, template, handoff))
        await _set(store, "finished", "1")
    finally:
        raw.close()
        sender.close()
        await peer_channel.close()
        await server.stop(0)
        peer.join(config.timeout_s)
        if peer.is_alive():
            peer.kill()


async def _measure(
    config: BenchKvConfig,
    num_tokens: int,
    store: Any,
    raw: PairChannel,
    registry: KvRegistry,
    template: HandleIssuer,
    handoff: Any,
) -> dict[str, Any]:
    layout = config.layout()
    clock = Clock(torch.device(config.device))
    target = transfer_device(config.backend_name, torch.device(config.device))
    generator = torch.Generator(device=config.device).manual_seed(num_tokens)
    shape = (1, config.kv_heads, num_tokens, config.head_dim)

    def random_half() -> torch.Tensor:
        values = torch.rand(shape, generator=generator, device=config.device, dtype=torch.float32)
        return values.to(config.torch_dtype)

    layers = [(random_half(), random_half()) for _ in range(config.layers)]
    start = clock.now()
    buf = pack(layers, layout, 0, 0, num_tokens, target)
    pack_s = clock.now() - start
    del layers

    dst = torch.empty_like(buf)
    memcpy_s = []
    for i in range(config.repeat + 1):
        start = clock.now()
        dst.copy_(buf)
        if i:
            memcpy_s.append(clock.now() - start)
    del dst

    num_bytes = buf.numel()
    sent_raw = digest([buf])
    sent_kv = digest([t for kv in unpack(buf, layout, num_tokens) for t in kv])
    await _set(store, f"size/{num_tokens}", json.dumps({"bytes": num_bytes}))

    transfer_s = []
    for i in range(config.repeat + 1):
        await _get(store, f"raw/{num_tokens}/{i}/posted")
        start = clock.now()
        await asyncio.wrap_future(raw.send(buf))
        done = float(await _get(store, f"raw/{num_tokens}/{i}/done"))
        if i:
            transfer_s.append(done - start)
    received_raw = (await _get(store, f"raw/{num_tokens}/digest")).decode()

    hop_s, control_s, data_s = [], [], []
    received_kv = ""
    for i in range(config.repeat + 1):
        entry = registry.park(buf, num_tokens)
        handle = template.issue(entry)
        last = i == config.repeat
        sent_at = clock.now()
        timed = await handoff(handle, metadata=((DIGEST_METADATA, "1"),) if last else None)
        if i:
            hop_s.append(timed["received_at"] - sent_at)
            control_s.append(timed["control_s"])
            data_s.append(timed["data_s"])
        if last:
            received_kv = timed["digest"]

    memcpy, transfer = statistics.median(memcpy_s), statistics.median(transfer_s)
    hop, control, data = statistics.median(hop_s), statistics.median(control_s), statistics.median(data_s)
    return {
        "tokens": num_tokens,
        "bytes": num_bytes,
        "mib": num_bytes / 2**20,
        "memcpy_gbps": num_bytes / memcpy / 1e9,
        "transfer_gbps": num_bytes / transfer / 1e9,
        "transfer_to_memcpy": memcpy / transfer,
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


async def _set(store: Any, key: str, value: str | bytes) -> None:
    await asyncio.to_thread(store.set, key, value)


async def _get(store: Any, key: str) -> bytes:
    value: bytes = await asyncio.to_thread(store.get, key)
    return value
