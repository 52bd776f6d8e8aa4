"""Starts a decode process: model, engine thread, KV puller, gRPC and metrics servers.

On SIGTERM it reports NOT_SERVING, refuses new Decode and DecodeMany calls and lets the streams in flight finish
within the grace period, then stops the engine and exits.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from prometheus_client import CollectorRegistry

from decode_service.engine import DecodeEngine
from decode_service.known_prefills import KnownPrefills
from decode_service.kv_pool import KvPool
from decode_service.kv_puller import KvPuller
from decode_service.kv_source import KvSource
from decode_service.metrics import DecodeMetrics
from decode_service.servicer import DecodeServicer
from pdserve.config import DecodeConfig
from pdserve.core.grammar import Grammars
from pdserve.hosting.service_kind import RankParts, ServiceKind
from pdserve.hosting.service_main import serve_service
from pdserve.kv import cuda_ipc, shared_memory
from pdserve.model.engine_model import EngineModel
from pdserve.model.shared_prefix_attention import enable_ragged_attention, enable_shared_prefix_attention
from pdserve.rpc.server import ServiceServer
from pdserve.rpc.service_security import internal_client
from pdserve.v1 import decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
DECODE_WORK = [f"/{SERVICE_NAME}/Decode", f"/{SERVICE_NAME}/DecodeMany"]


@dataclass
class DecodeParts:
    """Everything of a decode but its gRPC server: built once, served alone or colocated."""

    engine_model: EngineModel
    metrics: DecodeMetrics
    engine: DecodeEngine
    kv_source: KvSource
    known_prefills: KnownPrefills | None = None  # the prefills a puller takes KV from

    def warm_up(self) -> None:
        """Compiled forwards (``--compile``): runs steps of dummy sequences; nothing otherwise."""
        if self.engine_model.compiled:
            self.metrics.warmup_seconds.set(self.engine_model.warm_up(self.engine.warm_up))

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.stop)
        await self.kv_source.close()


def build_decode(
    config: DecodeConfig,
    engine_model: EngineModel,
    server: ServiceServer,
    kv_source: Callable[[DecodeMetrics], KvSource] | None = None,
) -> DecodeParts:
    """The decode's parts, with its servicer added to ``server``. By default the KV is pulled from
    remote prefills; ``kv_source`` replaces that (a colocated decode takes it in-process)."""
    metrics = DecodeMetrics(CollectorRegistry())
    known: KnownPrefills | None = None
    if kv_source is None:
        known = KnownPrefills(
            config.prefill,
            own_hosts=(config.server.host, config.server.public_host),
            interval_s=config.resolve_interval_s,
        )
        shm_dir = config.transfer.kv_shm_dir
        host_id = shared_memory.host_id(Path(shm_dir)) if shm_dir else ""
        source: KvSource = KvPuller(
            uuid.uuid4().hex,
            engine_model.fingerprint,
            engine_model.kv_layout,
            config.transfer.kv_backend,
            engine_model.device,
            config.server.public_host,
            timedelta(seconds=config.transfer.transfer_timeout_s),
            metrics,
            place=cuda_ipc.place_of(engine_model.device, host_id),
            shm_dir=shm_dir,
            known_prefills=known,
            security=internal_client(config.security),
        )
    else:
        source = kv_source(metrics)
    pool = KvPool(
        engine_model.kv_layout,
        config.max_kv_tokens // config.kv_block_size,
        config.kv_block_size,
        engine_model.device,
    )
    metrics.kv_cache_usage.set_function(lambda: pool.num_used_blocks / pool.num_blocks)
    engine = DecodeEngine(
        engine_model,
        metrics,
        config.max_running,
        pool,
        config.max_bypass,
        config.context_idle_s,
        shared_prefix=enable_shared_prefix_attention(
            engine_model.model, config.engine.no_shared_prefix_attention, "decode"
        ),
        ragged=enable_ragged_attention(engine_model.model, "decode"),
    )
    engine.start()
    servicer = DecodeServicer(
        engine,
        source,
        metrics,
        engine_model.limits,
        config.max_decode_waiting,
        config.max_pulled_waiting or config.max_running,
        Grammars(engine_model.tokenizer, engine_model.limits.vocab_size, engine_model.limits.eos_token_ids),
    )
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server.server)
    return DecodeParts(engine_model, metrics, engine, source, known)


def _build_rank(
    config: DecodeConfig, engine_model: EngineModel, server: ServiceServer, rank: int
) -> RankParts:
    parts = build_decode(config, engine_model, server)
    return RankParts(
        metrics=[("metrics", parts.metrics.registry, config.server.metrics_port)],
        busy=lambda: 0,
        close=parts.close,
        warm_up=parts.warm_up,
        background=[parts.known_prefills.run] if parts.known_prefills is not None else [],
    )


KIND = ServiceKind(
    "decode",
    DecodeConfig,
    [SERVICE_NAME],
    DECODE_WORK,
    _build_rank,
    routes_prefill=False,
    routes_decode=True,
)


async def serve(config: DecodeConfig) -> None:
    await serve_service(KIND, config)
