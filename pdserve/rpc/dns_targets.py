"""Service lists by address or by DNS name (``--prefill``, ``--decode``): the syntax and the resolver
the gateway's backend discovery and the decode's known prefills share.

An entry is a fixed address (``HOST:PORT``) or a name (``dns:///NAME:PORT``: every address NAME
resolves to, on PORT; on Kubernetes the headless Service of a StatefulSet, which lists its ready
pods).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.config.checks import DNS_SCHEME

# getaddrinfo's answers for "this name has no addresses" (others are failures to resolve).
NO_ADDRESS_ERRORS = frozenset(
    code for code in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None)) if code is not None
)

# (host, port) -> the "HOST:PORT" addresses; blocking; raises OSError when it cannot tell.
Resolver = Callable[[str, int], Sequence[str]]


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_host(address: str) -> str:
    """The host of ``HOST:PORT`` (IPv6 brackets dropped)."""
    return address.rpartition(":")[0].removeprefix("[").removesuffix("]")


def resolve_dns(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (``getaddrinfo``: /etc/hosts, then DNS), on ``port``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        if error.errno in NO_ADDRESS_ERRORS:
            return []
        raise
    return sorted({join_host_port(str(info[4][0]), int(info[4][1])) for info in infos})


@dataclass(frozen=True)
class BackendTarget:
    """One entry of a service list: a fixed address, or a name to resolve."""

    text: str  # as given: the address itself, or dns:///NAME:PORT
    host: str
    port: int

    @property
    def by_name(self) -> bool:
        return self.text.startswith(DNS_SCHEME)

    @classmethod
    def parse(cls, text: str) -> BackendTarget:
        host, _, port = text.removeprefix(DNS_SCHEME).rpartition(":")
        return cls(text, host.removeprefix("[").removesuffix("]"), int(port))


def fixed_addresses(targets: Sequence[str]) -> list[str]:
    """The entries of a service list that are addresses, not names."""
    return [t for t in targets if not BackendTarget.parse(t).by_name]
