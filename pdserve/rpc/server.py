"""Building, announcing and draining the gRPC server of a service.

Every service gets standard health checking (``grpc.health.v1``) and, unless its ``ServerSecurity``
turns it off, reflection; that security's gate (the internal token, the API key) sees every call
first, and its credentials serve the port over TLS. On SIGTERM or
SIGINT the service drains:
1. health reports NOT_SERVING at once (health and reflection keep answering while it drains);
2. new calls of its work methods (Generate, Prefill, Decode, DecodeMany) are refused with
   UNAVAILABLE, while other methods keep serving, so a prefill still hands out the KV it parked
   before (PullKvMany);
3. it waits until the work calls in flight have ended and the service reports nothing else busy
   (parked KV, sends in flight), or until the grace period ends;
4. streams still running then end with UNAVAILABLE at their next message (the caller may retry
   elsewhere), and the server stops: whatever is left is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.core.logs import configure_logging
from pdserve.core.nccl import configure_error_handling
from pdserve.rpc.service_security import OPEN, ServerSecurity

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Channel and server options of every pdserve gRPC endpoint: KV handles and responses may be large.
MESSAGE_SIZE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Calls gRPC's core holds before the service's event loop takes them. Beyond its default (1000) the
# core cancels the oldest with a bare CANCELLED and no log line: a burst of short requests lost
# that way instead of being answered. Services bound their own work (and answer RESOURCE_EXHAUSTED
# when full) once they take a call, so this bound only has to stay above any burst they can take.
MAX_PENDING_CALLS = 65536
DRAIN_POLL_S = 0.05
# After the grace period: how long streams get to end with UNAVAILABLE before the server stops.
HAND_BACK_S = 1.0


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts the calls of the work methods in flight; once closed, refuses new ones (UNAVAILABLE)."""

    def __init__(self, work_methods: Collection[str]) -> None:
        self._work_methods = frozenset(work_methods)
        self._closed = False
        self._expired = False
        self.in_flight = 0

    def close(self) -> None:
        """Refuse new work calls from now on."""
        self._closed = True

    def expire(self) -> None:
        """End the streams in flight with UNAVAILABLE at their next message."""
        self._expired = True

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method not in self._work_methods:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(method, handler.unary_unary),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(method, handler.unary_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._stream(method, handler.stream_stream),
                handler.request_deserializer,
                handler.response_serializer,
            )
        raise ValueError(f"{method}: client-streaming calls cannot be drained")

    async def _refuse(self, method: str, context: Any) -> None:
        await context.abort(
            grpc.StatusCode.UNAVAILABLE, f"{method}: this server is shutting down; send the call elsewhere"
        )

    def _unary(self, method: str, behavior: Callable[[Any, Any], Awaitable[Any]]) -> Any:
        async def call(request: Any, context: Any) -> Any:
            if self._closed:
                await self._refuse(method, context)
            self.in_flight += 1
            try:
                return await behavior(request, context)
            finally:
                self.in_flight -= 1

        return call

    def _stream(self, method: str, behavior: Callable[[Any, Any], AsyncGenerator[Any, None]]) -> Any:
        """Server-streaming calls, whether they take one request or a stream of them."""

        async def call(request: Any, context: Any) -> AsyncIterator[Any]:
            if self._closed:
                await self._refuse(method, context)
            self.in_flight += 1
            try:
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        if self._expired:
                            await context.abort(
                                grpc.StatusCode.UNAVAILABLE,
                                f"{method}: this server is shutting down and its grace period is over",
                            )
                        yield response
            finally:
                self.in_flight -= 1

        return call


class ServiceServer:
    """A grpc.aio server with health and reflection, bound to host:port (0 picks a free port).

    ``work_methods`` are the full names (``/package.Service/Method``) of the calls that drain
    refuses once it starts and waits for; ``advertise_host`` is the host in ``address`` ('' = host);
    a request message beyond ``max_receive_bytes`` is refused by gRPC (RESOURCE_EXHAUSTED);
    ``security``: who may call it and over what (default: anyone, plaintext, with reflection).
    """

    def __init__(
        self,
        host: str,
        port: int,
        service_names: Sequence[str],
        work_methods: Collection[str] = (),
        advertise_host: str = "",
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
        security: ServerSecurity = OPEN,
    ) -> None:
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
            ("grpc.so_reuseport", 0),
        ]
        self._gate = DrainGate(work_methods)
        interceptors: list[grpc.aio.ServerInterceptor] = [security.gate] if security.gate else []
        self.server = grpc.aio.server(options=options, interceptors=[*interceptors, self._gate])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = list(service_names)
        if security.reflection:
            reflection.enable_server_reflection(
                [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
            )
        self.host = advertise_host or host
        if security.credentials is None:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        else:
            self.port = self.server.add_secure_port(f"{host}:{port}", security.credentials)
        if self.port == 0:
            raise OSError(f"could not bind gRPC on {host}:{port}")

    @property
    def address(self) -> str:
        """HOST:PORT that other processes reach this server at."""
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        await self.server.start()
        await self._set_status(health_pb2.HealthCheckResponse.SERVING)

    async def drain(self, grace_s: float, busy: Callable[[], int] = lambda: 0) -> None:
        """NOT_SERVING at once; refuse new work; wait up to ``grace_s`` for the work in flight and
        for ``busy()`` (what else the service still holds) to reach 0; then stop the server."""
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._gate.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while (self._gate.in_flight or busy()) and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self._gate.in_flight or busy():
            logger.warning(
                "grace period over with %d calls in flight and %d other items busy; handing them back",
                self._gate.in_flight,
                busy(),
            )
            self._gate.expire()
            deadline = loop.time() + HAND_BACK_S
            while self._gate.in_flight and loop.time() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)
        await self.server.stop(max(0.0, deadline - loop.time()))

    async def fail(self, hold_s: float) -> None:
        """The service can no longer work: NOT_SERVING and new work refused at once; health keeps
        answering for ``hold_s`` (so callers see why), then the server stops."""
        await self._set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._gate.close()
        await asyncio.sleep(hold_s)
        self._gate.expire()
        await self.server.stop(HAND_BACK_S)

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


def announce_ready(service: str, **fields: Any) -> None:
    """Prints the one JSON ready line that launchers and tools read from stdout."""
    line = {"ready": True, "service": service, **fields, "pid": os.getpid()}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def abort_code_for(
    exc: BaseException, default: grpc.StatusCode = grpc.StatusCode.INTERNAL
) -> grpc.StatusCode:
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return default


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's event loop where it is installed (fewer CPU cycles per message), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_service(main: Callable[[], Any]) -> None:
    """Runs an async service entry point with pdserve's logging set-up."""
    configure_logging()
    configure_error_handling()  # before any NCCL group of this process exists
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        runner.run(main())
