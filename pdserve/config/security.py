"""Who may call a service: the internal credential every Prefill and Decode call carries (a shared
token, optionally mutual TLS between the services) and the gateway's public key and TLS.

The KV transport's own sockets (the rendezvous TCPStore, gloo and NCCL pairs) are not covered by
TLS: keep the services on a private network.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from pdserve.config.checks import check_file, check_file_pair

TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "PDSERVE_INTERNAL_TOKEN_FILE"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
KV_SOCKETS_NOTE = "the KV transport's sockets (TCPStore, gloo, NCCL) are not covered by TLS"


def check_token(name: str, token: str) -> None:
    """A shared secret sent as gRPC metadata: printable ASCII, no spaces, 16 to 4096 characters."""
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        raise ValueError(
            f"{name} must be {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} characters long, got {len(token)}"
        )
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(f"{name} must be printable ASCII without spaces")


def new_token() -> str:
    """A fresh random internal token (``pdserve up`` makes one per run when none is set)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class InternalSecurity:
    """The credential of the services' internal calls, on the servers that take them and on the
    clients that make them (gateway -> prefill/decode, decode -> prefill, rank routers -> ranks)."""

    internal_token: str = field(
        default="",
        metadata={
            "help": "shared token of the internal calls (environment only, never a flag)",
            "secret": True,
            "env_only": True,
        },
    )
    internal_token_file: str = field(
        default="",
        metadata={
            "help": f"file holding the shared token every internal call sends as the metadata "
            f"pdserve-internal-token (or set {TOKEN_ENV}; a prefill or decode refuses to start "
            "without one)"
        },
    )
    internal_tls_cert: str = field(
        default="",
        metadata={
            "help": "PEM certificate this service presents to the others (mutual TLS between services, "
            f"with --internal-tls-key and --internal-tls-ca; {KV_SOCKETS_NOTE})"
        },
    )
    internal_tls_key: str = field(default="", metadata={"help": "PEM private key of --internal-tls-cert"})
    internal_tls_ca: str = field(
        default="", metadata={"help": "PEM CA bundle that the other services' certificates must chain to"}
    )

    def __post_init__(self) -> None:
        if self.internal_token and self.internal_token_file:
            raise ValueError(f"set the internal token once: {TOKEN_ENV} or --internal-token-file, not both")
        if self.internal_token:
            check_token(TOKEN_ENV, self.internal_token)
        if self.internal_token_file:
            check_file("--internal-token-file", self.internal_token_file)
            check_token(f"the token in --internal-token-file {self.internal_token_file}", self._read_file())
        tls = (self.internal_tls_cert, self.internal_tls_key, self.internal_tls_ca)
        if any(tls) and not all(tls):
            raise ValueError(
                "mutual TLS between services needs all of --internal-tls-cert, --internal-tls-key "
                "and --internal-tls-ca"
            )
        check_file_pair(
            "--internal-tls-cert", self.internal_tls_cert, "--internal-tls-key", self.internal_tls_key
        )
        check_file("--internal-tls-ca", self.internal_tls_ca)

    def _read_file(self) -> str:
        with open(self.internal_token_file, encoding="utf-8") as file:
            return file.read().strip()

    @property
    def token(self) -> str:
        """The token ('' when none is configured)."""
        return self._read_file() if self.internal_token_file else self.internal_token

    @property
    def mutual_tls(self) -> bool:
        return bool(self.internal_tls_cert)

    def require_token(self, command: str) -> None:
        """Raises ValueError saying how to set a token when none is configured."""
        if not self.token:
            raise ValueError(
                f"{command} needs an internal token so that only pdserve's own services can call it: "
                f"set {TOKEN_ENV} or --internal-token-file (the same on every prefill, decode and "
                f'gateway; e.g. `export {TOKEN_ENV}="$(openssl rand -hex 32)"`)'
            )


@dataclass(frozen=True)
class PublicSecurity:
    """The gateway's public port: its API key, TLS and whether reflection is served."""

    api_key: str = field(
        default="",
        metadata={
            "help": "calls must send this key: HTTP `Authorization: Bearer KEY` under /v1, gRPC the "
            "metadata `authorization: Bearer KEY` ('' = no key; health stays open)",
            "secret": True,
        },
    )
    tls_cert: str = field(
        default="",
        metadata={"help": "PEM certificate: serve the public gRPC and HTTP over TLS (with --tls-key)"},
    )
    tls_key: str = field(default="", metadata={"help": "PEM private key of --tls-cert"})
    reflection: bool = field(
        default=False, metadata={"help": "serve gRPC reflection on the public port (off by default)"}
    )

    def __post_init__(self) -> None:
        if any(c.isspace() for c in self.api_key) or not self.api_key.isprintable():
            raise ValueError("api_key must be printable without spaces")
        check_file_pair("--tls-cert", self.tls_cert, "--tls-key", self.tls_key)
