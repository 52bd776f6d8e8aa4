"""Which prefills a decode pulls KV from: the hosts of its ``--prefill`` list, kept current.

A handle names the prefill (or the rank of a prefill group) holding its KV by ``HOST:PORT``; the
decode opens a connection to it only when HOST is known:
- with a ``--prefill`` list (the gateway's syntax: ``HOST:PORT`` or ``dns:///NAME:PORT``), the hosts
  of its fixed entries as written, and every address its names resolve to (again every
  ``interval_s``, and at once, at most once a second, when a handle names a host not known yet: a
  prefill pod that just came up). A host a name stops resolving to stays known for ``keep_s``
  (a draining prefill leaves its Service but still holds KV to pull). Any port of a known host:
  the ranks of a prefill group serve on ports of their own;
- without one, only this host: loopback, the decode's own ``--host``, and what this machine's
  hostname resolves to (a local stack, ``pdserve up``, keeps working as it is).
Anything else is refused with PERMISSION_DENIED before any connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Iterable, Sequence

from pdserve.rpc.dns_targets import BackendTarget, Resolver, resolve_dns, split_host

logger = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 5.0
RESOLVE_TIMEOUT_S = 5.0
MIN_REFRESH_S = 1.0
KEEP_S = 600.0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_hosts(own: Iterable[str] = ()) -> frozenset[str]:
    """This machine's names and addresses (its hostname's, and ``own``)."""
    names = {socket.gethostname(), socket.getfqdn(), *own}
    found = set(names)
    for name in names:
        try:
            found.update(str(info[4][0]) for info in socket.getaddrinfo(name, None))
        except OSError:
            continue
    return frozenset(h for h in found if h and h not in ("0.0.0.0", "::"))


class KnownPrefills:
    def __init__(
        self,
        targets: Sequence[str],
        own_hosts: Iterable[str] = (),
        resolver: Resolver = resolve_dns,
        interval_s: float = RESOLVE_INTERVAL_S,
        timeout_s: float = RESOLVE_TIMEOUT_S,
        keep_s: float = KEEP_S,
    ) -> None:
        self._keep_s = keep_s
        self._seen: dict[str, float] = {}  # host a name resolved to -> when, last
        parsed = [BackendTarget.parse(t) for t in targets]
        self._names = [t for t in parsed if t.by_name]
        self._fixed = frozenset(t.host for t in parsed if not t.by_name)
        self._local = local_hosts(own_hosts) if not parsed else frozenset()
        self._any_local = not parsed
        self._resolver = resolver
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._resolved: dict[BackendTarget, frozenset[str]] = {t: frozenset() for t in self._names}
        self._last_refresh = -MIN_REFRESH_S
        self._refreshing: asyncio.Future[None] | None = None

    def knows(self, address: str) -> bool:
        """Whether the prefill at ``address`` (``HOST:PORT``) is one this decode pulls from."""
        host = split_host(address)
        if self._any_local:
            return _is_loopback(host) or host in self._local
        seen = self._seen.get(host)
        return host in self._fixed or (seen is not None and time.monotonic() - seen <= self._keep_s)

    async def check(self, address: str) -> bool:
        """``knows``, after resolving the names once more when they may be stale."""
        if self.knows(address) or not self._names:
            return self.knows(address)
        if time.monotonic() - self._last_refresh >= MIN_REFRESH_S:
            await self.refresh()
        return self.knows(address)

    async def refresh(self) -> None:
        if self._refreshing is not None and not self._refreshing.done():
            await asyncio.shield(self._refreshing)
            return
        self._last_refresh = time.monotonic()
        self._refreshing = asyncio.ensure_future(self._resolve_all())
        await asyncio.shield(self._refreshing)

    async def run(self) -> None:
        """Resolves the names every ``interval_s`` until cancelled (nothing to do without names)."""
        if not self._names:
            return
        await self.refresh()
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh()

    async def _resolve_all(self) -> None:
        await asyncio.gather(*(self._resolve(t) for t in self._names))

    async def _resolve(self, target: BackendTarget) -> None:
        loop = asyncio.get_running_loop()
        try:
            addresses = await asyncio.wait_for(
                loop.run_in_executor(None, self._resolver, target.host, target.port), self._timeout_s
            )
        except (TimeoutError, OSError) as error:
            logger.warning("%s could not be resolved (%s); keeping its last addresses", target.text, error)
            return
        hosts = frozenset(split_host(a) for a in addresses)
        if hosts != self._resolved[target]:
            logger.info("known prefills %s: %s", target.text, ", ".join(sorted(hosts)) or "none")
        self._resolved[target] = hosts
        now = time.monotonic()
        self._seen.update(dict.fromkeys(hosts, now))
        for host, when in list(self._seen.items()):
            if now - when > self._keep_s:
                del self._seen[host]
