"""A gRPC server interceptor that lets a call through only when it carries a secret in its metadata
(the internal token, or the public API key), compared in constant time; UNAUTHENTICATED otherwise.

Methods under ``open_prefixes`` (health checking) stay open. The refusal names what is missing,
never the expected value.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health

HEALTH_PREFIX = f"/{health.SERVICE_NAME}/"


def metadata_value(metadata: Sequence[Any] | None, key: str) -> bytes:
    """The first value of ``key`` in a call's invocation metadata (b'' when absent)."""
    for item in metadata or ():
        name, value = item[0], item[1]
        if name == key:
            return value.encode() if isinstance(value, str) else bytes(value)
    return b""


class MetadataGate(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata ``key`` is not exactly ``expected``."""

    def __init__(
        self, key: str, expected: str, refusal: str, open_prefixes: Sequence[str] = (HEALTH_PREFIX,)
    ) -> None:
        if not expected:
            raise ValueError(f"the expected value of the {key} metadata must not be empty")
        self._key = key
        self._expected = expected.encode()
        self._refusal = refusal
        self._open = tuple(open_prefixes)

    def allows(self, method: str, metadata: Sequence[Any] | None) -> bool:
        if method.startswith(self._open):
            return True
        return hmac.compare_digest(metadata_value(metadata, self._key), self._expected)

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or self.allows(
            handler_call_details.method, handler_call_details.invocation_metadata
        ):
            return handler
        return self._refusing(handler)

    def _refusing(self, handler: Any) -> Any:
        refusal = self._refusal

        async def refuse_unary(request: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

        async def refuse_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
            yield  # pragma: no cover - abort raises

        serializers = (handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(refuse_unary, *serializers)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(refuse_stream, *serializers)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(refuse_unary, *serializers)
        return grpc.stream_stream_rpc_method_handler(refuse_stream, *serializers)
