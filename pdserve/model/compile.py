"""What torch.compile compiled in this process, as a counter of a service's Prometheus registry.

It counts the frames torch.compile turned into compiled code (a forward's first compilation and
every recompilation of a new shape class), read from torch's own counters when scraped. The
counter is the process's: a colocated process shows the same count on both of its registries.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from torch._dynamo.utils import counters


class CompiledFrames(Collector):
    def __init__(self, name: str, registry: CollectorRegistry) -> None:
        self._name = name
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        frames = counters.get("frames")
        yield CounterMetricFamily(
            self._name,
            "Frames torch.compile compiled in this process (recompilations included)",
            frames["ok"] if frames else 0,
        )
