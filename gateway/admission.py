"""The gateway's bound on the requests it serves at once (``--max-in-flight``).

A request takes a place before any other work (after its cheap input checks: before tokenizing or
templating) and gives it back when it ends in any way. One more than the bound is refused at once with RESOURCE_EXHAUSTED (HTTP 429 with
``Retry-After``): the gateway never queues work it cannot start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from gateway.metrics import GatewayMetrics
from pdserve.rpc.errors import RpcError


class Overloaded(RpcError):
    """RESOURCE_EXHAUSTED with the seconds a client should wait before it tries again."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self.retry_after_s = retry_after_s


class Place:
    """One admitted request's place; ``release`` gives it back (once, however often it is called)."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.admitted -= 1
            self._admission = None


class Admission:
    def __init__(self, max_in_flight: int, retry_after_s: int, metrics: GatewayMetrics) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self._metrics = metrics
        self.admitted = 0
        metrics.admitted.set_function(lambda: self.admitted)

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        """Holds one place while the block runs; raises Overloaded when every place is taken."""
        place = self.take()
        try:
            yield
        finally:
            place.release()

    def take(self) -> Place:
        """One place, to be released; raises Overloaded when every place is taken."""
        return self.take_many(1)[0]

    def take_many(self, count: int) -> list[Place]:
        """``count`` places (a batch of prompts), all or none; raises Overloaded when fewer are free."""
        if self.admitted + count > self.max_in_flight:
            self._metrics.shed.labels("gateway").inc()
            asked = "" if count == 1 else f"; {count} more would pass it"
            raise Overloaded(
                f"the gateway is serving {self.admitted} requests, its limit (--max-in-flight) "
                f"being {self.max_in_flight}{asked}; retry in {self.retry_after_s} s",
                self.retry_after_s,
            )
        self.admitted += count
        return [Place(self) for _ in range(count)]
