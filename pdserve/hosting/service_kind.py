"""What running a prefill, decode or colocated service takes, whatever the process layout.

A ``ServiceKind`` names a service's gRPC services and work methods and builds its parts for one
process (``RankParts``): metrics registries, what the ready line carries, what keeps a drain
waiting, background tasks and how to close. ``service_main`` runs a kind as one process, and
``hosting.ep_service`` as a group of ranks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from pdserve.hosting.metrics_server import MetricsServer
from pdserve.model.engine_model import EngineModel
from pdserve.rpc.server import ServiceServer
from pdserve.rpc.service_security import internal_server_security


@dataclass
class RankParts:
    """One process's service (a whole service, or one rank of an expert-parallel group)."""

    metrics: list[tuple[str, CollectorRegistry, int]]  # ready-line key, registry, port
    busy: Callable[[], int]
    close: Callable[[], Awaitable[None]]
    ready: dict[str, str] = field(default_factory=dict)
    background: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)
    # Blocking; run before the service is ready: warms up compiled forwards (``--compile``).
    warm_up: Callable[[], None] = lambda: None

    def serve_metrics(self, bind_host: str) -> dict[str, MetricsServer]:
        """One metrics server per registry, keyed by its ready-line key."""
        return {key: MetricsServer(bind_host, port, registry) for key, registry, port in self.metrics}


@dataclass(frozen=True)
class ServiceKind:
    """One service, as its processes are started."""

    command: str  # the pdserve subcommand
    config_cls: type
    service_names: list[str]
    work_methods: list[str]
    build: Callable[[Any, EngineModel, ServiceServer, int], RankParts]
    routes_prefill: bool
    routes_decode: bool
    decode_by_handle_rank: bool = False  # colocated: the KV is only on the rank that prefilled it

    def server(self, config: Any, port: int) -> ServiceServer:
        """A gRPC server of this service's names and work methods on ``port``, taking only calls
        with the internal token of ``config`` (the service's config)."""
        return ServiceServer(
            config.server.host,
            port,
            self.service_names,
            work_methods=self.work_methods,
            advertise_host=config.server.public_host,
            security=internal_server_security(config.security),
        )
