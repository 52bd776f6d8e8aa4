"""The shared-memory pieces of the same-host KV transport, on a private directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from pdserve.kv.shared_memory import (
    ALIGN,
    ArenaReader,
    InstanceLock,
    RegionAllocator,
    SharedArena,
    arena_path,
    host_id,
    is_alive,
    is_instance_id,
    sweep,
)
from tests.stack import REPO_ROOT, wait_for


def test_the_host_id_is_one_per_directory(tmp_path: Path) -> None:
    first = host_id(tmp_path)
    assert first and host_id(tmp_path) == first
    other = tmp_path / "other"
    other.mkdir()
    assert host_id(other) not in ("", first)
    assert host_id(tmp_path / "missing") == ""


def test_instance_ids_are_lowercase_hex_only(tmp_path: Path) -> None:
    assert is_instance_id(uuid.uuid4().hex)
    for bad in ("", "../etc", "ABC", "a/b", "x" * 10, "0" * 65):
        assert not is_instance_id(bad)
        with pytest.raises(ValueError):
            arena_path(tmp_path, bad)


def test_regions_are_aligned_reused_and_merged() -> None:
    allocator = RegionAllocator(10 * ALIGN + 5)
    assert allocator.capacity == 10 * ALIGN
    a, b, c = allocator.allocate(1), allocator.allocate(ALIGN + 1), allocator.allocate(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and allocator.used == 4 * ALIGN
    assert allocator.allocate(7 * ALIGN) is None
    allocator.free(b, ALIGN + 1)
    assert allocator.allocate(2 * ALIGN) == ALIGN  # the hole is reused
    allocator.free(ALIGN, 2 * ALIGN)
    allocator.free(a, 1)
    allocator.free(c, ALIGN)
    assert allocator.used == 0
    assert allocator.allocate(10 * ALIGN) == 0  # every free region merged back into one


def test_a_reader_sees_what_the_arena_holds_and_nothing_outside_it(tmp_path: Path) -> None:
    instance = uuid.uuid4().hex
    arena = SharedArena(tmp_path, instance, 1 << 20)
    try:
        region = arena.allocate(1000)
        assert region is not None
        offset, view = region
        data = torch.randint(0, 255, (1000,), dtype=torch.uint8)
        view.copy_(data)
        reader = ArenaReader(tmp_path, instance)
        assert torch.equal(reader.region(offset, 1000), data)
        view.fill_(7)  # the reader maps the same memory: no copy was made
        assert bool((reader.region(offset, 1000) == 7).all())
        for bad_offset, bad_size in ((1 << 20, 1), (-1, 10), (0, (1 << 20) + 1)):
            with pytest.raises(ValueError):
                reader.region(bad_offset, bad_size)
        assert arena.allocate(2 << 20) is None
    finally:
        arena.close()
    assert not arena.path.exists()


_HOLD = """
import sys, time
from pathlib import Path
from pdserve.kv.shared_memory import InstanceLock, SharedArena
lock = InstanceLock(Path(sys.argv[1]), sys.argv[2])
arena = SharedArena(Path(sys.argv[1]), sys.argv[2], 1 << 16)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_dead_prefills_arena_is_swept_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    dead, live = uuid.uuid4().hex, uuid.uuid4().hex
    mine = InstanceLock(tmp_path, live)
    SharedArena(tmp_path, live, 1 << 16)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path), dead], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        assert is_alive(tmp_path, dead) and is_alive(tmp_path, live)
        assert sweep(tmp_path) == 0
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(30)
        assert wait_for(lambda: not is_alive(tmp_path, dead), 5)
        assert sweep(tmp_path) == 1
        assert not arena_path(tmp_path, dead).exists()
        assert arena_path(tmp_path, live).exists()
    finally:
        holder.kill()
        mine.release()
    assert not is_alive(tmp_path, live)
