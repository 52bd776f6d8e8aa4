"""Which CPU cores each engine process of ``pdserve up`` runs on (``--cpu-bind``).

``auto`` (the default) on CPU: each prefill, decode or colocated process gets cores of its own, as
many as its threads (``--threads``) times its expert-parallel ranks (a colocated process runs a
prefill and a decode engine: twice that), taken in order from the CPUs ``pdserve up`` may run on,
when there are enough for all of them; the gateway is not bound (it runs where the engines leave
room). With too few CPUs, or on GPUs (whose engines mostly wait for their device), no process is
bound. ``none`` binds nothing. The binding itself is the engine's ``--cpus``
(``pdserve.hosting.cpu_binding``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from pdserve.config.cpu_list import format_cpu_list
from pdserve.launch.spec import COLOCATED, CPU_BIND_NONE, DECODE, PREFILL, UpConfig

logger = logging.getLogger(__name__)


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on; () where the OS does not say (no binding then)."""
    if not hasattr(os, "sched_getaffinity"):
        return ()
    return tuple(sorted(os.sched_getaffinity(0)))


def plan_cpus(config: UpConfig, cpus: Sequence[int]) -> dict[str, str]:
    """The CPU list of each engine process (by child name, ``prefill-0``...) out of ``cpus``; empty
    when none is bound."""
    if config.cpu_bind == CPU_BIND_NONE or config.uses_gpus or not cpus:
        return {}
    if config.mode == "colocated":
        sizes = [(f"{COLOCATED}-{i}", 2 * config.prefill_ep) for i in range(config.prefill_replicas)]
    else:
        sizes = [(f"{PREFILL}-{i}", config.prefill_ep) for i in range(config.prefill_replicas)]
        sizes += [(f"{DECODE}-{i}", config.decode_ep) for i in range(config.decode_replicas)]
    needed = sum(engines * config.threads for _, engines in sizes)
    if needed > len(cpus):
        logger.info(
            "engine processes not bound to CPUs: their threads need %d CPUs, %d are here", needed, len(cpus)
        )
        return {}
    plan: dict[str, str] = {}
    free = list(cpus)
    for name, engines in sizes:
        count = engines * config.threads
        plan[name], free = format_cpu_list(free[:count]), free[count:]
    return plan
