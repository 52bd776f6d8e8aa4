"""Building, announcing and draining the gRPC server of a service.

Every service gets standard health checking (``grpc.health.v1``) and reflection. On SIGTERM or
SIGINT the service reports NOT_SERVING at once, stops taking new calls and lets calls in flight
finish within the grace period.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ServiceServer:
    """A grpc.aio server with health and reflection, bound to host:port (0 picks a free port)."""

    def __init__(self, host: str, port: int, service_names: Sequence[str]) -> None:
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
        self.server = grpc.aio.server(options=options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        self.host = host
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"could not bind gRPC on {host}:{port}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self._set_status(health_pb2.HealthCheckResponse.SERVING)

    async def drain(self, grace_s: float) -> None:
        """NOT_SERVING at once, then stop accepting and give calls in flight ``grace_s`` to end."""
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(grace_s)

    async def _set_status(self, status: Any) -> None:
        for name in ("", *self._service_names):
            await self.health.set(name, status)


async def wait_for_stop_signal() -> None:
    """Returns on the first SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def announce_ready(service: str, out: TextIO = sys.stdout, **addresses: str) -> None:
    """Prints the one JSON ready line that launchers and tools read from stdout."""
    line = {"ready": True, "service": service, **addresses, "pid": os.getpid()}
    out.write(json.dumps(line) + "\n")
    out.flush()


def abort_code_for(
    exc: BaseException, default: grpc.StatusCode = grpc.StatusCode.INTERNAL
) -> grpc.StatusCode:
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return default


def run_service(main: Callable[[], Any]) -> None:
    """Runs an async service entry point with logging to stderr."""
    logging.basicConfig(
        level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s",
        stream=sys.stderr,
    )
    asyncio.run(main())
