"""The decode side (rank 1) of ``pdserve bench-kv``, run in a process of its own.

It receives each size over the raw PairChannel into a warm buffer (driven through the rendezvous
store) and serves one gRPC method, ``Handoff``, which carries a KV handle to it as the gateway's
Decode call carries one to a decode: it pulls the handle through a real ``KvPuller`` (PullKv over
gRPC, a fresh buffer per pull) and answers when the call arrived and the puller's control and
data times, plus, when asked, a digest of what arrived.
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
from typing import Any

import grpc
import torch
from prometheus_client import CollectorRegistry

from decode_service.kv_puller import KvPuller
from decode_service.metrics import DecodeMetrics
from pdserve.bench.kv.config import BenchKvConfig
from pdserve.kv.channel import DECODE_RANK, PairChannel, transfer_device
from pdserve.kv.rendezvous import connect_store
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
    puller = KvPuller(
        uuid.uuid4().hex, FINGERPRINT, config.layout(), backend, device, config.host, timeout, metrics
    )
    clock = Clock(device)

    async def handoff(handle: kv_pb2.KvHandle, context: Any) -> bytes:
        received_at = clock.now()
        pulled = await puller.pull_timed(handle)
        answer: dict[str, Any] = {
            "received_at": received_at,
            "control_s": pulled.control_s,
            "data_s": pulled.data_s,
        }
        if any(key == DIGEST_METADATA for key, _ in context.invocation_metadata()):
            answer["digest"] = digest([t for kv in pulled.layers for t in kv])
        del pulled  # the buffer is freed before the answer, outside the next handoff's times
        return json.dumps(answer).encode()

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(
        handoff, request_deserializer=kv_pb2.KvHandle.FromString, response_serializer=lambda b: b
    )
    service, method = HANDOFF_METHOD.strip("/").split("/")
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, {method: handler})])
    port = server.add_insecure_port(f"{config.host}:0")
    await server.start()
    await _set(store, "peer/address", f"{config.host}:{port}")
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
            await _set(store, f"raw/{num_tokens}/digest", digest([warm]))
            del warm
        await _get(store, "finished")
    finally:
        raw.close()
        await server.stop(0)
        await puller.close()


async def _set(store: Any, key: str, value: str | bytes) -> None:
    await asyncio.to_thread(store.set, key, value)


async def _get(store: Any, key: str) -> bytes:
    value: bytes = await asyncio.to_thread(store.get, key)
    return value
