"""Binds an engine process to CPU cores of its own (``--cpus``).

On a CPU machine the prefill and the decode each keep a core busy, next to the gateway and the
clients. Left to the scheduler, their threads move between cores and each arrives on caches the
other filled; bound to a core each (as vLLM binds its CPU engine's threads,
``VLLM_CPU_OMP_THREADS_BIND``), each keeps its own. Measured on the 2-core CPU machine, reference
burst of ``shared/PEERS.md``, two stacks side by side, alternating bursts: medians 2111 against 1895
and 2191 against 1761 output tok/s (``docs/benchmarks.md``).

Every thread the process has is bound, and the threads it starts later (torch's, gRPC's, the
expert-parallel ranks it spawns) inherit the binding.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from pdserve.config.cpu_list import format_cpu_list

logger = logging.getLogger(__name__)

TASKS = Path("/proc/self/task")


def bind_process(cpus: Sequence[int], tasks: Path = TASKS) -> None:
    """Runs every thread of this process (those listed under ``tasks``) on ``cpus`` from now on.
    ValueError when this OS cannot bind or ``cpus`` are not all allowed to this process."""
    if not cpus:
        return
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("--cpus needs an OS that binds threads to CPUs (Linux)")
    allowed = os.sched_getaffinity(0)
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise ValueError(
            f"--cpus {format_cpu_list(cpus)}: CPUs {format_cpu_list(outside)} are not among this "
            f"process's allowed CPUs {format_cpu_list(allowed)}"
        )
    os.sched_setaffinity(0, cpus)  # this thread first: the threads it starts from now on inherit it
    for task in tasks.iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, ValueError):  # a thread that ended meanwhile
            continue
    logger.info("bound to CPUs %s", format_cpu_list(cpus))
