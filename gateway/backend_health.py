"""What the gateway knows of one backend's health, and the probe loop that keeps it current.

Each backend is asked ``grpc.health.v1.Health/Check`` every ``PROBE_INTERVAL_S`` on the channel
its calls use, with a deadline of ``PROBE_TIMEOUT_S``:
- ``SERVING`` -> SERVING; ``NOT_SERVING`` (draining, say) -> NOT_SERVING: no new requests, calls
  in flight go on;
- the call fails at once (connection refused or lost) -> UNREACHABLE, and the backend is *down*;
- ``HUNG_AFTER_TIMEOUTS`` probes in a row run past their deadline (a stopped or wedged process
  whose socket still accepts) -> UNREACHABLE and down.
A backend that is down has its calls in flight ended by the gateway (see ``BackendHealth.down``),
so no request waits on it past the probe's bound. A call failing with UNAVAILABLE also marks its
backend UNREACHABLE (not down) until the next probe answers.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 1.5
HUNG_AFTER_TIMEOUTS = 2


class Health(enum.Enum):
    UNKNOWN = "unknown"  # not probed yet
    SERVING = "serving"
    NOT_SERVING = "not serving"
    UNREACHABLE = "unreachable"


class BackendHealth:
    def __init__(self, address: str) -> None:
        self.address = address
        self.state = Health.UNKNOWN
        self.reason = "not probed yet"
        self.down = asyncio.Event()  # set while the backend is unreachable or hung
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Calls ``listener`` after every change of state or reason."""
        self._listeners.append(listener)

    @property
    def serving(self) -> bool:
        return self.state is Health.SERVING

    def update(self, state: Health, reason: str, down: bool = False) -> None:
        if down:
            self.down.set()
        elif state is not Health.UNREACHABLE:
            self.down.clear()
        if state is self.state and reason == self.reason:
            return
        if state is not self.state:
            log = logger.info if state in (Health.SERVING, Health.UNKNOWN) else logger.warning
            log("backend %s: %s -> %s (%s)", self.address, self.state.value, state.value, reason)
        self.state = state
        self.reason = reason
        for listener in self._listeners:
            listener()

    def call_failed(self, code: grpc.StatusCode, details: str) -> None:
        """A call on this backend failed with UNAVAILABLE: skip it until the next probe answers."""
        if code == grpc.StatusCode.UNAVAILABLE and self.state is Health.SERVING:
            self.update(Health.UNREACHABLE, f"a call failed: {details}")


async def probe_forever(channel: grpc.aio.Channel, health: BackendHealth) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    timeouts = 0
    while True:
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                timeouts += 1
                if timeouts >= HUNG_AFTER_TIMEOUTS:
                    health.update(
                        Health.UNREACHABLE, f"{timeouts} health checks in a row got no answer", down=True
                    )
            else:
                timeouts = 0
                health.update(Health.UNREACHABLE, f"health check failed: {exc.code().name}", down=True)
        else:
            timeouts = 0
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                health.update(Health.SERVING, "health check says SERVING")
            else:
                name = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
                health.update(Health.NOT_SERVING, f"health check says {name}")
        await asyncio.sleep(PROBE_INTERVAL_S)
