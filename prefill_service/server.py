"""Starts a prefill process: model, rendezvous store, registry, engine, gRPC and metrics servers.

Lifecycle of the process: load the model -> host the KV rendezvous store -> serve (announce the
ready line) -> on SIGTERM report NOT_SERVING, refuse new Prefill calls, keep serving PullKv and
ReleaseKv until what is parked has been pulled, released or has expired and every send has ended
(or the grace period is over), then free the rest and exit.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from prometheus_client import CollectorRegistry

from pdserve.config import PrefillConfig
from pdserve.hosting.service_kind import RankParts, ServiceKind
from pdserve.hosting.service_main import serve_service
from pdserve.kv.channel import transfer_device
from pdserve.kv.handle import HandleIssuer
from pdserve.kv.layout import dtype_name
from pdserve.kv.rendezvous import host_store
from pdserve.model.engine_model import EngineModel
from pdserve.rpc.server import ServiceServer
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc
from prefill_service.engine import PrefillEngine
from prefill_service.kv_registry import KvRegistry
from prefill_service.kv_sender import KvSender
from prefill_service.metrics import PrefillMetrics
from prefill_service.servicer import PrefillServicer

logger = logging.getLogger(__name__)

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
PREFILL_WORK = f"/{SERVICE_NAME}/Prefill"
EXPIRY_INTERVAL_S = 0.25


async def expire_leases(registry: KvRegistry, metrics: PrefillMetrics) -> None:
    while True:
        await asyncio.sleep(EXPIRY_INTERVAL_S)
        for entry in registry.expire():
            metrics.kv_expiries.inc()
            logger.info("KV handle %s expired unpulled (%d bytes)", entry.handle_id.hex(), entry.num_bytes)


@dataclass
class PrefillParts:
    """Everything of a prefill but its gRPC server: built once, served alone or colocated."""

    engine_model: EngineModel
    metrics: PrefillMetrics
    registry: KvRegistry
    sender: KvSender
    engine: PrefillEngine
    store: dist.TCPStore
    kv_rendezvous: str

    def busy(self) -> int:
        return self.registry.num_parked + self.sender.num_in_flight

    async def run_expiry(self) -> None:
        await expire_leases(self.registry, self.metrics)

    def warm_up(self) -> None:
        """Compiled forwards (``--compile``): runs them once on dummy prompts; nothing otherwise."""
        if self.engine_model.compiled:
            self.metrics.warmup_seconds.set(self.engine.warm_up())

    def close(self) -> None:
        self.sender.close()
        self.engine.close()


def build_prefill(
    config: PrefillConfig, engine_model: EngineModel, server: ServiceServer, rank: int = 0
) -> PrefillParts:
    """The prefill's parts, with its servicer added to ``server``; its KV handles name ``rank``
    (of an expert-parallel group) and ``server``'s address."""
    backend = config.transfer.backend_for(config.engine.device)
    device = transfer_device(backend, engine_model.device)
    timeout = timedelta(seconds=config.transfer.transfer_timeout_s)
    instance_id = uuid.uuid4().hex
    host = config.server.public_host
    store = host_store(config.server.host, config.kv_port, timeout)

    metrics = PrefillMetrics(CollectorRegistry())
    registry = KvRegistry(config.lease_s)
    metrics.track_parked(lambda: registry.num_parked, lambda: registry.num_bytes_parked)
    sender = KvSender(instance_id, store, backend, engine_model.device, host, timeout, metrics)
    engine = PrefillEngine(engine_model, device, config.batch_tokens)
    metrics.track_queue(lambda: engine.num_waiting, lambda: engine.num_running)
    kv_rendezvous = f"{host}:{store.port}"
    issuer = HandleIssuer(
        prefill_address=server.address,
        prefill_instance_id=instance_id,
        rendezvous_address=kv_rendezvous,
        backend=backend,
        model_fingerprint=engine_model.fingerprint,
        layout=engine_model.kv_layout,
        rank=rank,
    )
    layout = engine_model.kv_layout
    logger.info(
        "KV: %d layers, %s, %d bytes per token, backend %s",
        layout.num_layers,
        dtype_name(layout.dtype),
        layout.bytes_per_token(),
        backend,
    )
    servicer = PrefillServicer(engine_model, engine, registry, sender, metrics, issuer)
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server.server)
    return PrefillParts(engine_model, metrics, registry, sender, engine, store, kv_rendezvous)


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
        ready={"kv_rendezvous": parts.kv_rendezvous},
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
