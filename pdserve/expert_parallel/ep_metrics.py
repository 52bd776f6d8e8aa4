"""Prometheus counters of one rank of an expert-parallel group, read from its lockstep and dispatch."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.expert_parallel.dispatch import Dispatch
from pdserve.expert_parallel.lockstep import Lockstep


class EpCollector(Collector):
    def __init__(self, rank: int, size: int, lockstep: Lockstep, dispatch: Dispatch) -> None:
        self._rank = rank
        self._size = size
        self._lockstep = lockstep
        self._dispatch = dispatch

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._dispatch.stats
        yield GaugeMetricFamily(
            "pdserve_ep_rank", "rank of this process in its expert-parallel group", self._rank
        )
        yield GaugeMetricFamily("pdserve_ep_size", "ranks of the expert-parallel group", self._size)
        yield GaugeMetricFamily(
            "pdserve_ep_broken",
            "1 once the group failed (a rank died or a wait timed out)",
            int(self._lockstep.broken),
        )
        yield CounterMetricFamily("pdserve_ep_ticks", "forwards the group ran in step", self._lockstep.ticks)
        yield CounterMetricFamily(
            "pdserve_ep_filler_forwards",
            "ticks this rank had no work and ran a one-token filler forward",
            self._lockstep.fillers,
        )
        yield CounterMetricFamily("pdserve_ep_moe_calls", "MoE layer calls through the dispatch", stats.calls)
        yield CounterMetricFamily(
            "pdserve_ep_idle_experts",
            "MoE layer calls in which a local expert received no token",
            stats.idle_experts,
        )
        yield CounterMetricFamily(
            "pdserve_ep_idle_ranks",
            "MoE layer calls in which this rank received no token at all",
            stats.idle_ranks,
        )


def register_ep_metrics(
    registry: CollectorRegistry, rank: int, size: int, lockstep: Lockstep, dispatch: Dispatch
) -> None:
    registry.register(EpCollector(rank, size, lockstep, dispatch))
