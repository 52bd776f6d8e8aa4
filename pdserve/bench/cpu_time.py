"""CPU seconds (user + system) spent by server process trees between two snapshots.

A server is a root process and its live descendants (vLLM's engine core, pdserve's replicas).
The figure is least disturbed by other load on a shared machine, unlike wall time.
"""

from __future__ import annotations

from collections.abc import Iterable

import psutil


def _tree_cpu_s(pid: int) -> dict[int, float]:
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    seconds: dict[int, float] = {}
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        seconds[process.pid] = times.user + times.system
    return seconds


class CpuMeter:
    """Measures the CPU seconds of the trees of ``pids`` from ``start()`` to ``stop()``."""

    def __init__(self, pids: Iterable[int]) -> None:
        self.pids = sorted(set(pids))
        self._before: dict[int, float] = {}

    def _snapshot(self) -> dict[int, float]:
        snapshot: dict[int, float] = {}
        for pid in self.pids:
            snapshot.update(_tree_cpu_s(pid))
        return snapshot

    def start(self) -> None:
        self._before = self._snapshot()

    def stop(self) -> float:
        """CPU seconds since ``start()`` of the processes alive at the end (new ones in full)."""
        after = self._snapshot()
        return sum(max(0.0, seconds - self._before.get(pid, 0.0)) for pid, seconds in after.items())
