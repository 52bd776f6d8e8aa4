"""The gateway's backends by address or by DNS name, kept current while it runs.

A backend list (``--prefill``, ``--decode``) mixes fixed addresses (``HOST:PORT``) and names
(``dns:///NAME:PORT``: every address NAME resolves to, on PORT; on Kubernetes the headless Service
of a StatefulSet, which lists its ready pods). A list of fixed addresses only is used as given,
never resolved. With names:
1. at start the names are resolved once, before the gateway serves;
2. every ``interval_s`` they are resolved again, off the event loop, each resolution bounded by
   ``timeout_s`` (a name whose previous resolution still hangs is not asked again meanwhile);
3. the pool's members become the fixed addresses plus every address found (``BackendPool.update``):
   a new one is routed to once its health check says SERVING, one that is gone is drained (no new
   requests; those running there finish);
4. a name the resolver cannot answer for now (a DNS timeout or failure: ``OSError``, or any other
   error of the resolver) keeps its last addresses; a name without addresses (no such name, or a Service without a ready pod) has none.

The resolver is a parameter, so that tests can change what names resolve to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from gateway.backends import BackendPool
from pdserve.rpc.dns_targets import BackendTarget, Resolver, fixed_addresses, resolve_dns

__all__ = ["BackendTarget", "Discovery", "Resolver", "fixed_addresses", "resolve_dns"]

logger = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 5.0
RESOLVE_TIMEOUT_S = 5.0


class Discovery:
    """Keeps ``pool``'s members those of ``targets`` (see the module docstring)."""

    def __init__(
        self,
        pool: BackendPool[Any],
        targets: Sequence[str],
        resolver: Resolver = resolve_dns,
        interval_s: float = RESOLVE_INTERVAL_S,
        timeout_s: float = RESOLVE_TIMEOUT_S,
    ) -> None:
        self._pool = pool
        self.fixed = fixed_addresses(targets)
        self._names = [t for t in map(BackendTarget.parse, targets) if t.by_name]
        self._resolver = resolver
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._found: dict[BackendTarget, list[str]] = {t: [] for t in self._names}
        self._pending: dict[BackendTarget, asyncio.Future[Sequence[str]]] = {}

    @property
    def by_name(self) -> bool:
        """Whether any target is a name (else the pool's members never change)."""
        return bool(self._names)

    async def refresh(self) -> None:
        """Resolves every name once (concurrently) and updates the pool's members."""
        if not self._names:
            return
        await asyncio.gather(*(self._resolve(target) for target in self._names))
        found = [address for target in self._names for address in self._found[target]]
        self._pool.update([*self.fixed, *found])

    async def run(self) -> None:
        """Refreshes every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh()

    async def close(self) -> None:
        for pending in self._pending.values():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending

    async def _resolve(self, target: BackendTarget) -> None:
        pending = self._pending.get(target)
        if pending is not None and not pending.done():
            return  # the previous resolution still hangs: keep the last addresses
        loop = asyncio.get_running_loop()
        pending = loop.run_in_executor(None, self._resolver, target.host, target.port)
        self._pending[target] = pending
        name = target.text
        try:
            addresses = list(await asyncio.wait_for(asyncio.shield(pending), self._timeout_s))
        except TimeoutError:
            logger.warning("%s: no answer within %.1f s; keeping its last addresses", name, self._timeout_s)
            return
        except OSError as error:
            logger.warning("%s could not be resolved (%s); keeping its last addresses", name, error)
            return
        except Exception:
            logger.exception("the resolver failed on %s; keeping its last addresses", name)
            return
        if addresses != self._found[target]:
            logger.info("%s resolves to %s", name, ", ".join(addresses) or "no address")
        self._found[target] = addresses
