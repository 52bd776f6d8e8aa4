"""The gateway's HTTP server: uvicorn serving an ASGI app as a task of the gateway's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

STARTUP_POLL_S = 0.01


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves SIGTERM/SIGINT to the gateway, which stops it on drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Binds ``host:port`` at construction (0 picks a free port; OSError when it cannot); ``tls``:
    (certificate file, key file) to serve HTTPS."""

    def __init__(
        self, app: Any, host: str, port: int, grace_s: float, tls: tuple[str, str] | None = None
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family)
        self.host = host
        self.port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=math.ceil(grace_s),
            ssl_certfile=tls[0] if tls else None,
            ssl_keyfile=tls[1] if tls else None,
        )
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Returns once the server accepts connections."""
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP server on {self.address} stopped during startup")
            await asyncio.sleep(STARTUP_POLL_S)

    async def stop(self) -> None:
        """Stops accepting, lets responses in flight end within the grace period, then cancels them."""
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        await self._task
