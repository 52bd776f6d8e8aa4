"""What torch.compile compiled in this process, and its cache lookups, as counters of a service's registry.

It counts the frames torch.compile turned into compiled code (a forward's first compilation and
every recompilation of a new shape class), read from torch's own counters when scraped. The
counter is the process's: a colocated process shows the same count on both of its registries.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

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


# (label of the cache, torch counter group, hit counter, miss counter)
_CACHES = (
    ("fx_graph", "inductor", "fxgraph_cache_hit", "fxgraph_cache_miss"),
    ("aot_autograd", "aot_autograd", "autograd_cache_hit", "autograd_cache_miss"),
)


class CompileCacheLookups(Collector):
    """Lookups of torch.compile's caches of compiled code in this process, by cache and result: a
    warm start (the cache dir holding the model's code) shows hits and no misses."""

    def __init__(self, name: str, registry: CollectorRegistry) -> None:
        self._name = name
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            self._name,
            "Lookups of torch.compile's compiled-code caches in this process (cache: fx_graph or "
            "aot_autograd; result: hit or miss)",
            labels=["cache", "result"],
        )
        for label, group, hit, miss in _CACHES:
            found: Mapping[str, int] = counters.get(group) or {}
            family.add_metric([label, "hit"], found.get(hit, 0))
            family.add_metric([label, "miss"], found.get(miss, 0))
        yield family
