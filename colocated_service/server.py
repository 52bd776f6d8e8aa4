"""Starts a colocated process: one model, the prefill and decode services on one gRPC server,
and the KV handed from the prefill's registry to the decode in memory (no transfer).

The gateway is pointed at this one address as both its prefill and its decode. The ready line
carries both metrics addresses (``metrics`` for the decode side, ``prefill_metrics``). With
``--ep N`` every rank is such a colocated service and a request decodes on the rank that
prefilled it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from colocated_service.local_kv_source import LocalKvSource
from decode_service.metrics import DecodeMetrics
from decode_service.server import DECODE_WORK, DecodeParts, build_decode
from decode_service.server import SERVICE_NAME as DECODE_SERVICE
from pdserve.config import ColocatedConfig
from pdserve.hosting.service_kind import RankParts, ServiceKind
from pdserve.hosting.service_main import serve_service
from pdserve.model.engine_model import EngineModel
from pdserve.rpc.server import ServiceServer
from prefill_service.server import PREFILL_WORK, PrefillParts, build_prefill
from prefill_service.server import SERVICE_NAME as PREFILL_SERVICE

logger = logging.getLogger(__name__)

SERVICES = [PREFILL_SERVICE, DECODE_SERVICE]
WORK_METHODS = [PREFILL_WORK, *DECODE_WORK]


@dataclass
class ColocatedParts:
    prefill: PrefillParts
    decode: DecodeParts

    def warm_up(self) -> None:
        self.prefill.warm_up()
        self.decode.warm_up()

    async def close(self) -> None:
        await self.decode.close()
        self.prefill.close()


def build_colocated(
    config: ColocatedConfig, engine_model: EngineModel, server: ServiceServer, rank: int = 0
) -> ColocatedParts:
    prefill = build_prefill(config.prefill_config(), engine_model, server, rank)

    def local_source(metrics: DecodeMetrics) -> LocalKvSource:
        return LocalKvSource(
            prefill.registry,
            engine_model.fingerprint,
            engine_model.kv_layout,
            metrics,
            prefill.metrics,
        )

    decode = build_decode(config.decode_config(), engine_model, server, kv_source=local_source)
    return ColocatedParts(prefill, decode)


def _build_rank(
    config: ColocatedConfig, engine_model: EngineModel, server: ServiceServer, rank: int
) -> RankParts:
    parts = build_colocated(config, engine_model, server, rank)
    return RankParts(
        metrics=[
            ("metrics", parts.decode.metrics.registry, config.server.metrics_port),
            ("prefill_metrics", parts.prefill.metrics.registry, config.prefill_metrics_port),
        ],
        busy=parts.prefill.busy,
        close=parts.close,
        background=[parts.prefill.run_expiry],
        warm_up=parts.warm_up,
    )


KIND = ServiceKind(
    "colocated",
    ColocatedConfig,
    SERVICES,
    WORK_METHODS,
    _build_rank,
    routes_prefill=True,
    routes_decode=True,
    decode_by_handle_rank=True,
)


async def serve(config: ColocatedConfig) -> None:
    await serve_service(KIND, config)
