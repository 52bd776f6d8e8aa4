"""The decode side (rank 1) of ``pdserve bench-kv``, run in a process of its own.

It receives each size over the raw PairChannel into a warm buffer, then pulls it through a real
``KvPuller`` (PullKv over gRPC, a fresh buffer per pull, as a decode does) and reports, through
the rendezvous store, when each receive ended, the puller's control and data times, the digests
of what arrived and the time of one unary RPC between the two processes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import secrets
import statistics
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import grpc
import torch
from prometheus_client import CollectorRegistry

from decode_service.kv_puller import KvPuller
from decode_service.metrics import DecodeMetrics
from pdserve.bench_kv_config import BenchKvConfig
from pdserve.kv_transport import DECODE_RANK, PairChannel, connect_store, transfer_device
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc

FINGERPRINT = "pdserve-bench-kv"
RAW_PREFIX = "pdserve/bench-kv/raw/"
RPC_SAMPLES = 20


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


def run_peer(config: BenchKvConfig, rendezvous: str) -> None:
    torch.set_num_threads(config.threads)
    asyncio.run(_serve(config, rendezvous))


async def _serve(config: BenchKvConfig, rendezvous: str) -> None:
    backend = config.backend_name
    device = torch.device(config.receiver_device)
    timeout = timedelta(seconds=config.timeout_s)
    store = connect_store(rendezvous, timeout)
    raw = PairChannel(store, RAW_PREFIX, DECODE_RANK, backend, device, config.host, timeout)
    metrics = DecodeMetrics(CollectorRegistry())
    layout = config.layout()
    puller = KvPuller(uuid.uuid4().hex, FINGERPRINT, layout, backend, device, config.host, timeout, metrics)
    clock = Clock(device)
    target = transfer_device(backend, device)
    try:
        for num_tokens in config.token_counts:
            size = json.loads(await _get(store, f"size/{num_tokens}"))
            warm = torch.empty(size["bytes"], dtype=torch.uint8, device=target)
            for i in range(config.repeat + 1):
                future: concurrent.futures.Future[None] = raw.recv(warm)
                await _set(store, f"raw/{num_tokens}/{i}/posted", "1")
                await asyncio.wrap_future(future)
                await _set(store, f"raw/{num_tokens}/{i}/done", str(clock.now()))
            received = {"raw": digest([warm])}
            del warm
            handle = kv_pb2.KvHandle()
            for i in range(config.repeat + 1):
                handle = kv_pb2.KvHandle.FromString(await _get(store, f"handoff/{num_tokens}/{i}"))
                pulled = await puller.pull_timed(handle)
                timed = {"control_s": pulled.control_s, "data_s": pulled.data_s}
                await _set(store, f"handoff/{num_tokens}/{i}/timed", json.dumps(timed))
                if i == config.repeat:
                    received["kv"] = digest([t for kv in pulled.layers for t in kv])
                del pulled
            rpc_s = await _rpc_seconds(handle.prefill_address)
            await _set(store, f"size/{num_tokens}/received", json.dumps({**received, "rpc_s": rpc_s}))
    finally:
        raw.close()
        await puller.close()


async def _rpc_seconds(address: str) -> float:
    """Median time of a unary RPC (ReleaseKv of an unknown handle) to the prefill side."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = prefill_pb2_grpc.PrefillStub(channel)
        samples = []
        for _ in range(RPC_SAMPLES + 1):
            start = time.perf_counter()
            await stub.ReleaseKv(prefill_pb2.ReleaseKvRequest(handle_id=secrets.token_bytes(16)))
            samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


async def _set(store: Any, key: str, value: str | bytes) -> None:
    await asyncio.to_thread(store.set, key, value)


async def _get(store: Any, key: str) -> bytes:
    value: bytes = await asyncio.to_thread(store.get, key)
    return value
