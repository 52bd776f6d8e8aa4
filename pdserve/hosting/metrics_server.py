"""Serving a service's own Prometheus registry over HTTP."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server


class MetricsServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self._server: Any
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._server.server_port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
