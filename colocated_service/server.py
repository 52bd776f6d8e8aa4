"""Starts a colocated process: one model, the prefill and decode services on one gRPC server,
and the KV handed from the prefill's registry to the decode in memory (no transfer).

The gateway is pointed at this one address as both its prefill and its decode. The ready line
carries both metrics addresses (``metrics`` for the decode side, ``prefill_metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from decode_service.local_kv_source import LocalKvSource
from decode_service.metrics import DecodeMetrics
from decode_service.server import DECODE_WORK, build_decode
from decode_service.server import SERVICE_NAME as DECODE_SERVICE
from pdserve.config import ColocatedConfig
from pdserve.engine_model import load_engine_model
from pdserve.grpc_server import ServiceServer, announce_ready, wait_for_stop_signal
from pdserve.metrics_server import MetricsServer
from prefill_service.server import PREFILL_WORK, build_prefill
from prefill_service.server import SERVICE_NAME as PREFILL_SERVICE

logger = logging.getLogger(__name__)


async def serve(config: ColocatedConfig) -> None:
    prefill_config = config.prefill_config()
    decode_config = config.decode_config()
    engine_model = await asyncio.to_thread(load_engine_model, config.engine)
    host = config.server.public_host
    server = ServiceServer(
        config.server.host,
        config.server.port,
        [PREFILL_SERVICE, DECODE_SERVICE],
        work_methods=[PREFILL_WORK, DECODE_WORK],
        advertise_host=host,
    )
    prefill = build_prefill(prefill_config, engine_model, server)
    backend = prefill_config.transfer.backend_for(config.engine.device)

    def local_source(metrics: DecodeMetrics) -> LocalKvSource:
        return LocalKvSource(
            prefill.registry,
            engine_model.fingerprint,
            backend,
            engine_model.kv_layout,
            metrics,
            prefill.metrics,
        )

    decode = build_decode(decode_config, engine_model, server, kv_source=local_source)
    decode_metrics = MetricsServer(config.server.host, config.server.metrics_port, decode.metrics.registry)
    prefill_metrics = MetricsServer(config.server.host, config.prefill_metrics_port, prefill.metrics.registry)
    await server.start()
    expiry = asyncio.create_task(prefill.run_expiry())
    announce_ready(
        "colocated",
        grpc=server.address,
        metrics=f"{host}:{decode_metrics.port}",
        prefill_metrics=f"{host}:{prefill_metrics.port}",
        kv_rendezvous=prefill.kv_rendezvous,
    )
    await wait_for_stop_signal()
    logger.info("draining colocated prefill+decode (grace %.1fs)", config.server.grace_s)
    await server.drain(config.server.grace_s, busy=prefill.busy)
    expiry.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await expiry
    await decode.close()
    prefill.close()
    decode_metrics.close()
    prefill_metrics.close()
    logger.info("colocated service stopped")
