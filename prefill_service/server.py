"""Starts a prefill process: model, registry, engine, gRPC and metrics servers.

The prefill listens on its gRPC port (and metrics) only: each KV pair's two ends meet through that
pair's own store in this process, which a decode reaches by the Prefill service's PairStore call.

Lifecycle of the process: load the model -> serve (announce the ready line) -> on SIGTERM report
NOT_SERVING, refuse new Prefill calls, keep serving PullKvMany and ReleaseKv until what is parked
has been pulled, released or has expired and every send has ended (or the grace period is over),
then free the rest and exit.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

from prometheus_client import CollectorRegistry

from pdserve.config import PrefillConfig
from pdserve.hosting.service_kind import RankParts, ServiceKind
from pdserve.hosting.service_main import serve_service
from pdserve.kv import cuda_ipc, shared_memory
from pdserve.kv.handle import HandleIssuer
from pdserve.kv.layout import dtype_name
from pdserve.kv.shared_memory import InstanceLock, SharedArena
from pdserve.kv.transports import AUTO, SHM, offers
from pdserve.model.engine_model import EngineModel
from pdserve.model.shared_prefix_attention import enable_shared_prefix_attention
from pdserve.rpc.server import ServiceServer
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from prefill_service.engine import PrefillEngine
from prefill_service.forward_size import ForwardSize
from prefill_service.kv_lender import KvLender
from prefill_service.kv_registry import KvRegistry
from prefill_service.kv_sender import KvSender
from prefill_service.kv_space import KvSpace
from prefill_service.metrics import PrefillMetrics
from prefill_service.prefix_cache import PrefixCache, default_capacity_tokens, reuse_problem
from prefill_service.servicer import PrefillServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
PREFILL_WORK = f"/{SERVICE_NAME}/Prefill"
EXPIRY_INTERVAL_S = 0.25
MAX_DEFAULT_ARENA_BYTES = 4 << 30


async def expire_leases(registry: KvRegistry, lender: KvLender, metrics: PrefillMetrics) -> None:
    """Frees KV whose lease ended unpulled, and KV lent to decodes that died."""
    while True:
        await asyncio.sleep(EXPIRY_INTERVAL_S)
        for entry in registry.expire():
            metrics.kv_expiries.inc()
            logger.info("KV handle %s expired unpulled (%d bytes)", entry.handle_id.hex(), entry.num_bytes)
        metrics.kv_reclaimed.inc(await asyncio.to_thread(lender.reclaim))


def shared_memory_arena(
    config: PrefillConfig, instance_id: str
) -> tuple[str, SharedArena | None, InstanceLock | None]:
    """This prefill's shared-memory domain, arena and instance lock (none when it has no use for them:
    no shared memory, a GPU prefill, or a transport that is not shm)."""
    if not config.transfer.kv_shm_dir:
        return "", None, None
    directory = Path(config.transfer.kv_shm_dir)
    host = shared_memory.host_id(directory)
    if not host or config.engine.device != "cpu" or config.transfer.kv_backend not in (AUTO, SHM):
        return host, None, None
    capacity = config.kv_shm_bytes or default_arena_bytes(directory)
    if capacity <= 0:
        return host, None, None
    shared_memory.sweep(directory)
    lock = InstanceLock(directory, instance_id)  # before the arena: a sweep never takes it for a dead one
    try:
        return host, SharedArena(directory, instance_id, capacity), lock
    except OSError as exc:
        lock.release()
        logger.warning(
            "no shared-memory KV arena of %d bytes in %s (%s): KV moves over gloo", capacity, directory, exc
        )
        return host, None, None


def default_arena_bytes(directory: Path) -> int:
    """A quarter of the shared-memory filesystem, at most ``MAX_DEFAULT_ARENA_BYTES``."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return 0
    return min(stats.f_frsize * stats.f_blocks // 4, MAX_DEFAULT_ARENA_BYTES)


def build_prefix_cache(
    config: PrefillConfig, engine_model: EngineModel, metrics: PrefillMetrics
) -> PrefixCache | None:
    """The prefill's prefix cache, or None when it is off or cannot reuse this model's KV exactly."""
    if not config.prefix_cache_on:
        logger.info("prefix cache: off")
        return None
    problem = reuse_problem(engine_model.model)
    if problem is not None:
        logger.warning("prefix cache: off, %s cannot be reused exactly: %s", config.engine.model, problem)
        return None
    capacity = config.prefix_cache_tokens
    if capacity < 0:
        capacity = default_capacity_tokens(engine_model.kv_layout.bytes_per_token(), engine_model.device)
    started = time.perf_counter()
    cache = PrefixCache(
        config.prefix_block_size,
        capacity,
        engine_model.kv_layout,
        engine_model.device,
        metrics.prefix_cache_evicted_tokens.inc,
    )
    metrics.track_prefix_cache(cache)
    logger.info(
        "prefix cache: %d tokens in blocks of %d (%d bytes per token), its memory written in %.2f s",
        cache.capacity_tokens,
        cache.block_size,
        engine_model.kv_layout.bytes_per_token(),
        time.perf_counter() - started,
    )
    return cache


@dataclass
class PrefillParts:
    """Everything of a prefill but its gRPC server: built once, served alone or colocated."""

    engine_model: EngineModel
    metrics: PrefillMetrics
    registry: KvRegistry
    sender: KvSender
    lender: KvLender
    space: KvSpace
    engine: PrefillEngine
    lock: InstanceLock | None = None

    def busy(self) -> int:
        return self.registry.num_parked + self.sender.num_in_flight + self.lender.num_lent

    async def run_expiry(self) -> None:
        await expire_leases(self.registry, self.lender, self.metrics)

    def warm_up(self) -> None:
        """Compiled forwards (``--compile``): runs them once on dummy prompts; then measures a
        forward's fixed cost where the forward size follows the queue."""
        if self.engine_model.compiled:
            self.metrics.warmup_seconds.set(self.engine_model.warm_up(self.engine.warm_up))
        self.metrics.forward_fixed_tokens.set(self.engine.calibrate().fixed_tokens)

    def close(self) -> None:
        self.sender.close()
        self.engine.close()
        self.lender.close()
        self.space.close()
        if self.lock is not None:
            self.lock.release()


def build_prefill(
    config: PrefillConfig, engine_model: EngineModel, server: ServiceServer, rank: int = 0
) -> PrefillParts:
    """The prefill's parts, with its servicer added to ``server``; its KV handles name ``rank``
    (of an expert-parallel group) and ``server``'s address."""
    backend = config.transfer.backend_for(config.engine.device)
    timeout = timedelta(seconds=config.transfer.transfer_timeout_s)
    instance_id = uuid.uuid4().hex
    host = config.server.public_host
    host_id, arena, lock = shared_memory_arena(config, instance_id)
    place = cuda_ipc.place_of(engine_model.device, host_id)
    space = KvSpace(config.transfer.kv_backend, place, engine_model.device, arena)

    metrics = PrefillMetrics(CollectorRegistry())
    registry = KvRegistry(config.lease_s)
    lender = KvLender(partial(shared_memory.is_alive, Path(config.transfer.kv_shm_dir)))
    metrics.track_parked(lambda: registry.num_parked, lambda: registry.num_bytes_parked)
    metrics.track_lent(lender, space)
    sender = KvSender(instance_id, backend, engine_model.device, host, timeout, metrics)
    prefix_cache = build_prefix_cache(config, engine_model, metrics)
    shared_prefix = enable_shared_prefix_attention(
        engine_model.model, config.engine.no_shared_prefix_attention, "prefill"
    )
    engine = PrefillEngine(
        engine_model,
        space,
        config.batch_tokens,
        prefix_cache,
        shared_prefix,
        ForwardSize(*config.forward_tokens),
    )
    metrics.track_queue(lambda: engine.num_waiting, lambda: engine.num_running)
    issuer = HandleIssuer(
        prefill_address=server.address,
        prefill_instance_id=instance_id,
        model_fingerprint=engine_model.fingerprint,
        layout=engine_model.kv_layout,
        place=place,
        rank=rank,
    )
    layout = engine_model.kv_layout
    logger.info(
        "KV: %d layers, %s, %d bytes per token; offers %s; shared-memory arena %s",
        layout.num_layers,
        dtype_name(layout.dtype),
        layout.bytes_per_token(),
        ", ".join(offers(config.transfer.kv_backend, place, arena is not None)) or "nothing",
        f"{arena.capacity} bytes at {arena.path}" if arena is not None else "none",
    )
    servicer = PrefillServicer(
        engine_model, engine, registry, sender, metrics, issuer, lender, config.max_prefill_waiting
    )
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server.server)
    return PrefillParts(engine_model, metrics, registry, sender, lender, space, engine, lock)


def _build_rank(
    config: PrefillConfig, engine_model: EngineModel, server: ServiceServer, rank: int
) -> RankParts:
    parts = build_prefill(config, engine_model, server, rank)

    async def close() -> None:
        parts.close()

    return RankParts(
        metrics=[("metrics", parts.metrics.registry, config.server.metrics_port)],
        busy=parts.busy,
        close=close,
        background=[parts.run_expiry],
        warm_up=parts.warm_up,
    )


KIND = ServiceKind(
    "prefill",
    PrefillConfig,
    [SERVICE_NAME],
    [PREFILL_WORK],
    _build_rank,
    routes_prefill=True,
    routes_decode=False,
)


async def serve(config: PrefillConfig) -> None:
    await serve_service(KIND, config)
