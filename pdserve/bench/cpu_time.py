"""CPU seconds of server process trees between two snapshots, and the seconds their threads waited
for a CPU.

A server is a root process and its live descendants (vLLM's engine core, pdserve's replicas).
CPU seconds (user + system) are least disturbed by other load on a shared machine, unlike wall
time. The run-queue wait is the other side: the time a thread was ready to run but every CPU it
may use ran something else (Linux ``/proc/PID/task/TID/schedstat``, second field). Where processes
share too few cores, a server's latency grows by its waits, not by its CPU seconds; per process,
the two tell whose work waited and how long.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil

# Words of a process's command line kept to name it in a report.
COMMAND_WORDS = 6
COMMAND_CHARS = 120


@dataclass(frozen=True)
class ProcessUsage:
    pid: int
    command: str  # the first words of its command line
    cpu_s: float
    run_queue_wait_s: float | None  # None where the kernel does not report it


@dataclass(frozen=True)
class ServerUsage:
    """What the server trees used between ``start`` and ``stop``, the busiest process first."""

    processes: tuple[ProcessUsage, ...]

    @property
    def cpu_s(self) -> float:
        return sum(p.cpu_s for p in self.processes)

    @property
    def run_queue_wait_s(self) -> float | None:
        waits = [p.run_queue_wait_s for p in self.processes]
        if not waits or None in waits:
            return None
        return sum(w for w in waits if w is not None)

    def as_rows(self) -> list[dict[str, object]]:
        return [
            {"pid": p.pid, "command": p.command, "cpu_s": p.cpu_s, "run_queue_wait_s": p.run_queue_wait_s}
            for p in self.processes
        ]


@dataclass(frozen=True)
class _Snapshot:
    command: str
    cpu_s: float
    waits: dict[int, float] | None  # seconds waited, by thread id


def run_queue_waits(pid: int, proc: Path = Path("/proc")) -> dict[int, float] | None:
    """Seconds each live thread of ``pid`` has waited on a run queue, by thread id; None where the
    kernel gives no schedstat (not Linux, or built without it)."""
    try:
        tids = [entry.name for entry in (proc / str(pid) / "task").iterdir()]
    except OSError:
        return None
    waits: dict[int, float] = {}
    for tid in tids:
        try:
            fields = (proc / str(pid) / "task" / tid / "schedstat").read_text().split()
        except OSError:
            continue  # the thread ended meanwhile
        if len(fields) < 2:
            return None
        waits[int(tid)] = int(fields[1]) / 1e9
    return waits


def _command(process: psutil.Process) -> str:
    try:
        words = process.cmdline()
    except psutil.Error:
        words = []
    if not words:
        try:
            return process.name()
        except psutil.Error:
            return ""
    return " ".join(words[:COMMAND_WORDS])[:COMMAND_CHARS]


def _tree(pid: int) -> dict[int, _Snapshot]:
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {}
    snapshots: dict[int, _Snapshot] = {}
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        snapshots[process.pid] = _Snapshot(
            _command(process), times.user + times.system, run_queue_waits(process.pid)
        )
    return snapshots


def _waited(before: _Snapshot | None, after: _Snapshot) -> float | None:
    """Seconds ``after``'s threads waited since ``before`` (threads born meanwhile in full)."""
    if after.waits is None:
        return None
    if before is None:
        earlier: dict[int, float] = {}
    elif before.waits is None:
        return None
    else:
        earlier = before.waits
    return sum(max(0.0, s - earlier.get(tid, 0.0)) for tid, s in after.waits.items())


class CpuMeter:
    """Measures the trees of ``pids`` from ``start()`` to ``stop()``."""

    def __init__(self, pids: Iterable[int]) -> None:
        self.pids = sorted(set(pids))
        self._before: dict[int, _Snapshot] = {}

    def _snapshot(self) -> dict[int, _Snapshot]:
        snapshot: dict[int, _Snapshot] = {}
        for pid in self.pids:
            snapshot.update(_tree(pid))
        return snapshot

    def start(self) -> None:
        self._before = self._snapshot()

    def stop(self) -> ServerUsage:
        """Usage since ``start()`` of the processes alive at the end (new ones in full)."""
        after = self._snapshot()
        usage = []
        for pid, now in after.items():
            before = self._before.get(pid)
            cpu_s = max(0.0, now.cpu_s - (before.cpu_s if before is not None else 0.0))
            usage.append(ProcessUsage(pid, now.command, cpu_s, _waited(before, now)))
        usage.sort(key=lambda p: (-p.cpu_s, p.pid))
        return ServerUsage(tuple(usage))
