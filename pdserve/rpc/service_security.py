"""The security of a pdserve gRPC server (the gate on its calls, its TLS, reflection) and of the
clients of internal services, built from the config.

Internal servers (prefill, decode, an expert-parallel group's routers and ranks) refuse every call
without the internal token but health checks; with mutual TLS they also require and verify a client
certificate. The gateway's public port asks for the API key (when one is set) and serves TLS with
``--tls-cert``/``--tls-key``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from pdserve.config.security import InternalSecurity, PublicSecurity
from pdserve.rpc.channel_security import AUTHORIZATION_KEY, INTERNAL_TOKEN_KEY, ChannelSecurity, read_pem
from pdserve.rpc.metadata_gate import MetadataGate

INTERNAL_REFUSAL = (
    "this is an internal pdserve service: calls must carry the internal token (metadata "
    f"{INTERNAL_TOKEN_KEY})"
)
PUBLIC_REFUSAL = f"missing or wrong API key: send the metadata `{AUTHORIZATION_KEY}: Bearer KEY`"


@dataclass(frozen=True)
class ServerSecurity:
    """What a ``ServiceServer`` checks: ``gate`` on every call, TLS ``credentials`` on its port
    (None: plaintext), and whether it serves reflection."""

    gate: MetadataGate | None = None
    credentials: grpc.ServerCredentials | None = None
    reflection: bool = True


OPEN = ServerSecurity()


def internal_server_security(security: InternalSecurity) -> ServerSecurity:
    """The token gate (ValueError when no token is set) and, with mutual TLS, the credentials."""
    token = security.token
    if not token:
        raise ValueError("an internal server needs a token")
    credentials = None
    if security.mutual_tls:
        credentials = grpc.ssl_server_credentials(
            [(Path(security.internal_tls_key).read_bytes(), Path(security.internal_tls_cert).read_bytes())],
            root_certificates=Path(security.internal_tls_ca).read_bytes(),
            require_client_auth=True,
        )
    return ServerSecurity(MetadataGate(INTERNAL_TOKEN_KEY, token, INTERNAL_REFUSAL), credentials)


def internal_client(security: InternalSecurity) -> ChannelSecurity:
    """How a service calls another: the token on every call, and its certificate under mutual TLS."""
    metadata = ((INTERNAL_TOKEN_KEY, security.token),) if security.token else ()
    if not security.mutual_tls:
        return ChannelSecurity(metadata)
    return ChannelSecurity(
        metadata,
        tls=True,
        root_certificates=read_pem(security.internal_tls_ca),
        private_key=read_pem(security.internal_tls_key),
        certificate_chain=read_pem(security.internal_tls_cert),
    )


def public_server_security(public: PublicSecurity) -> ServerSecurity:
    """The gateway's public port: the API key gate, TLS, reflection only when asked for."""
    gate = (
        MetadataGate(AUTHORIZATION_KEY, f"Bearer {public.api_key}", PUBLIC_REFUSAL)
        if public.api_key
        else None
    )
    credentials = None
    if public.tls_cert:
        credentials = grpc.ssl_server_credentials(
            [(Path(public.tls_key).read_bytes(), Path(public.tls_cert).read_bytes())]
        )
    return ServerSecurity(gate, credentials, reflection=public.reflection)
