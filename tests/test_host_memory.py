"""The host memory a process may use, under a container's cgroup limit (``pdserve.kv.host_memory``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pdserve.kv.host_memory import cgroup_memory_limit, host_memory_bytes
from prefill_service.prefix_cache import MAX_DEFAULT_BYTES, default_capacity_tokens

GIB = 1 << 30
PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _tree(tmp_path: Path, cgroup_lines: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake /proc (its self/cgroup) and /sys/fs/cgroup holding ``files`` (path: content)."""
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    for name, text in files.items():
        (cgroups / name).parent.mkdir(parents=True, exist_ok=True)
        (cgroups / name).write_text(text)
    return proc, cgroups


def test_a_v2_limit_on_the_process_cgroup_or_above_it_bounds_the_memory(tmp_path: Path) -> None:
    proc, cgroups = _tree(
        tmp_path,
        "0::/kubepods/pod1/app\n",
        {
            "kubepods/pod1/app/memory.max": "max\n",
            "kubepods/pod1/memory.max": f"{3 * GIB}\n",
            "kubepods/memory.max": f"{8 * GIB}\n",
        },
    )
    assert cgroup_memory_limit(proc, cgroups) == 3 * GIB
    assert host_memory_bytes(proc, cgroups) == min(PHYSICAL, 3 * GIB)


def test_a_namespaced_container_reads_its_root(tmp_path: Path) -> None:
    proc, cgroups = _tree(tmp_path, "0::/\n", {"memory.max": f"{2 * GIB}\n"})
    assert cgroup_memory_limit(proc, cgroups) == 2 * GIB


def test_a_v1_memory_controller_limit_counts_and_its_unlimited_value_does_not(tmp_path: Path) -> None:
    proc, cgroups = _tree(
        tmp_path,
        "4:memory:/docker/abc\n3:cpuset:/\n0::/\n",
        {
            "memory/docker/abc/memory.limit_in_bytes": f"{GIB}\n",
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "cpuset/memory.limit_in_bytes": "1\n",  # another controller's hierarchy: not read
        },
    )
    assert cgroup_memory_limit(proc, cgroups) == GIB
    proc, cgroups = _tree(
        tmp_path / "unlimited", "4:memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712\n"}
    )
    assert cgroup_memory_limit(proc, cgroups) is None
    assert host_memory_bytes(proc, cgroups) == PHYSICAL


def test_no_cgroup_file_system_leaves_the_machine_memory(tmp_path: Path) -> None:
    assert cgroup_memory_limit(tmp_path / "none", tmp_path / "none") is None
    proc, cgroups = _tree(tmp_path, "0::/user.slice\n", {})  # no memory.max anywhere
    assert cgroup_memory_limit(proc, cgroups) is None
    assert host_memory_bytes(proc, cgroups) == PHYSICAL


def test_the_default_prefix_cache_is_a_sixteenth_of_that_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("prefill_service.prefix_cache.host_memory_bytes", lambda: 2 * GIB)  # a container's
    assert default_capacity_tokens(8192, torch.device("cpu")) == 2 * GIB // 16 // 8192
    monkeypatch.setattr("prefill_service.prefix_cache.host_memory_bytes", lambda: 512 * GIB)
    assert default_capacity_tokens(8192, torch.device("cpu")) == MAX_DEFAULT_BYTES // 8192
