"""How a client reaches a pdserve server: plaintext or TLS (optionally presenting its own
certificate), and the metadata every call carries (the internal token, the API key).

``ChannelSecurity()`` is a plain channel with no metadata; ``aio_channel``/``channel`` make the
grpc.aio and blocking channels; the metadata rides on each call through a client interceptor.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

INTERNAL_TOKEN_KEY = "pdserve-internal-token"
AUTHORIZATION_KEY = "authorization"

Metadata = tuple[tuple[str, str], ...]


def _merged(metadata: Any, extra: Metadata) -> list[tuple[str, Any]]:
    return [*(tuple(item) for item in (metadata or ())), *extra]


class _AioInjector:
    """Adds fixed metadata to the calls of a grpc.aio channel (one subclass per kind of call: a
    grpc.aio channel files each interceptor under the first kind it implements)."""

    def __init__(self, metadata: Metadata) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=grpc.aio.Metadata(*_merged(details.metadata, self._metadata)))


class _AioUnaryUnary(_AioInjector, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _AioUnaryStream(_AioInjector, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _AioStreamUnary(_AioInjector, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _AioStreamStream(_AioInjector, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def aio_injectors(metadata: Metadata) -> list[grpc.aio.ClientInterceptor]:
    """The interceptors that add ``metadata`` to every call of a grpc.aio channel."""
    return [kind(metadata) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class MetadataInjector(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds fixed metadata to every call of a blocking channel."""

    def __init__(self, metadata: Metadata) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        return _CallDetails(
            details.method,
            details.timeout,
            _merged(details.metadata, self._metadata),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


def read_pem(path: str) -> bytes | None:
    """The bytes of a PEM file ('' = none)."""
    return Path(path).read_bytes() if path else None


@dataclass(frozen=True)
class ChannelSecurity:
    """TLS (``tls``: verify the server against ``root_certificates``, or the system's roots when
    None; present ``certificate_chain``/``private_key`` when set) and the metadata of every call."""

    metadata: Metadata = ()
    tls: bool = False
    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    @classmethod
    def public(cls, api_key: str = "", tls_ca: str = "", tls: bool = False) -> ChannelSecurity:
        """A client of the gateway: its API key and, with ``tls`` or a ``tls_ca``, TLS."""
        metadata: Metadata = ((AUTHORIZATION_KEY, f"Bearer {api_key}"),) if api_key else ()
        return cls(metadata, tls=tls or bool(tls_ca), root_certificates=read_pem(tls_ca))

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        interceptors = aio_injectors(self.metadata) if self.metadata else None
        if self.tls:
            return grpc.aio.secure_channel(
                address, self._credentials(), options=list(options), interceptors=interceptors
            )
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        if self.tls:
            channel = grpc.secure_channel(address, self._credentials(), options=list(options))
        else:
            channel = grpc.insecure_channel(address, options=list(options))
        if self.metadata:
            return grpc.intercept_channel(channel, MetadataInjector(self.metadata))
        return channel


PLAIN = ChannelSecurity()
