"""How much host memory this process may use: the machine's, or less where a cgroup limits it.

A container's memory limit (Docker's ``--memory``, a Kubernetes pod's ``limits.memory``) is its
cgroup's: ``memory.max`` under cgroup v2, ``memory.limit_in_bytes`` under v1. The machine's memory
(``sysconf``) says nothing of it, so a default sized from that alone can exceed what the container
may hold and be killed at start. The limit read is the smallest over this process's cgroup and the
ones above it, as the kernel enforces each; inside a cgroup namespace the process sees its own
cgroup as the root, and the root's files are read too.
"""

from __future__ import annotations

import os
from pathlib import Path

# v1 writes "no limit" as the largest page-aligned 64-bit value, v2 as "max".
UNLIMITED_FROM = 1 << 60


def host_memory_bytes(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int:
    """The machine's memory, or this process's cgroup limit where that is smaller."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_limit(proc, cgroups)
    return physical if limit is None else min(physical, limit)


def cgroup_memory_limit(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The smallest memory limit on this process's cgroups and their parents, in bytes; None where
    there is none (or no cgroup file system)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, path = parts[1], Path(parts[2].lstrip("/"))
        if controllers == "":  # v2: the one hierarchy
            base, name = cgroups, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = cgroups / "memory", "memory.limit_in_bytes"
        else:
            continue
        for directory in (path, *path.parents):
            limit = _read_limit(base / directory / name)
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def _read_limit(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max", or nothing
        return None
    value = int(text)
    return value if value < UNLIMITED_FROM else None
