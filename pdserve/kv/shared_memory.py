"""KV in shared memory: one arena file per prefill in a tmpfs (``/dev/shm``) that decodes of the same
host map once and read in place.

Lifecycle of a KV in the arena:
1. the prefill reserves a region (``SharedArena.allocate``) and packs the KV straight into it;
2. a decode of the same host takes the KV (PullKvMany with the shm transport): the prefill answers
   with the region's offset and keeps the region lent to that decode;
3. the decode reads the region through its own mapping of the arena (``ArenaReader``) and copies
   it once into its pool, then gives it back (ReleaseKv); the prefill frees the region;
4. a region lent to a decode that died (its ``InstanceLock`` is free) is freed by the prefill.

Two processes share memory when they see the same directory: ``host_id`` is a random id kept in a
file there. Every process that takes part holds an exclusive lock on a file of its own for its life
(``InstanceLock``), so a peer's death is seen by trying its lock; ``sweep`` removes the arenas of
prefills that died.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import time
import warnings
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_DIR = Path("/dev/shm")
PREFIX = "pdserve-kv-"
ARENA_SUFFIX = ".arena"
LOCK_SUFFIX = ".lock"
HOST_ID_FILE = "pdserve-host-id"
ALIGN = 4096
_HEX = re.compile(r"[0-9a-f]{1,64}")


def is_instance_id(text: str) -> bool:
    """Whether ``text`` can name an arena or a lock: lowercase hex, as instance ids are."""
    return bool(_HEX.fullmatch(text))


def arena_path(directory: Path, instance_id: str) -> Path:
    if not is_instance_id(instance_id):
        raise ValueError(f"instance id must be lowercase hex, got {instance_id!r}")
    return directory / f"{PREFIX}{instance_id}{ARENA_SUFFIX}"


def lock_path(directory: Path, instance_id: str) -> Path:
    if not is_instance_id(instance_id):
        raise ValueError(f"instance id must be lowercase hex, got {instance_id!r}")
    return directory / f"{PREFIX}{instance_id}{LOCK_SUFFIX}"


def host_id(directory: Path = DEFAULT_DIR) -> str:
    """The id of the shared-memory domain of ``directory``; '' when it cannot be used."""
    path = directory / HOST_ID_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
    except OSError as exc:
        logger.info("no shared memory at %s (%s): the same-host KV transport is off", directory, exc)
        return ""
    else:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(16))
    for _ in range(100):  # the process that created it may not have written it yet
        with contextlib.suppress(OSError):
            text = path.read_text().strip()
            if text:
                return text
        time.sleep(0.01)
    return ""


class InstanceLock:
    """An exclusive lock a process holds on its own file for its life; free once it dies."""

    def __init__(self, directory: Path, instance_id: str) -> None:
        final = lock_path(directory, instance_id)
        staging = directory / f".{final.name}.{secrets.token_hex(4)}"
        self._fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.rename(staging, final)  # visible only once locked: never taken for a dead one
        self.path = final

    def release(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            os.close(self._fd)


def is_alive(directory: Path, instance_id: str) -> bool:
    """Whether the process of ``instance_id`` holds its lock (False once it died or released it)."""
    try:
        fd = os.open(lock_path(directory, instance_id), os.O_RDONLY)
    except (OSError, ValueError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    return False


class RegionAllocator:
    """First fit over ``ALIGN``-aligned regions of ``capacity`` bytes; freed neighbours merge."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity // ALIGN * ALIGN
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []  # by offset
        self.used = 0

    def allocate(self, num_bytes: int) -> int | None:
        """The offset of a new region of at least ``num_bytes``, or None when none fits."""
        size = _aligned(max(num_bytes, 1))
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self.used += size
                return offset
        return None

    def free(self, offset: int, num_bytes: int) -> None:
        size = _aligned(max(num_bytes, 1))
        i = bisect.bisect(self._free, (offset, 0))
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            i -= 1
            offset, size = self._free[i][0], self._free[i][1] + size
            del self._free[i]
        if i < len(self._free) and offset + size == self._free[i][0]:
            size += self._free[i][1]
            del self._free[i]
        self._free.insert(i, (offset, size))
        self.used -= _aligned(max(num_bytes, 1))


class SharedArena:
    """A prefill's arena: one file mapped read-write; KV buffers are regions of it."""

    def __init__(self, directory: Path, instance_id: str, capacity: int) -> None:
        self.path = arena_path(directory, instance_id)
        self._allocator = RegionAllocator(capacity)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(self._allocator.capacity, ALIGN))
            self._mapping = mmap.mmap(fd, max(self._allocator.capacity, ALIGN))
        except BaseException:
            with contextlib.suppress(OSError):
                self.path.unlink()
            raise
        finally:
            os.close(fd)
        self._tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)

    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    @property
    def used(self) -> int:
        return self._allocator.used

    def allocate(self, num_bytes: int) -> tuple[int, torch.Tensor] | None:
        """A region of ``num_bytes``: its offset and a view; None when the arena is full."""
        offset = self._allocator.allocate(num_bytes)
        if offset is None:
            return None
        return offset, self._tensor.narrow(0, offset, num_bytes)

    def free(self, offset: int, num_bytes: int) -> None:
        self._allocator.free(offset, num_bytes)

    def close(self) -> None:
        """Removes the file; the memory goes once every mapping of it is gone."""
        with contextlib.suppress(OSError):
            self.path.unlink()


class ArenaReader:
    """A decode's read-only mapping of one prefill's arena."""

    def __init__(self, directory: Path, instance_id: str) -> None:
        path = arena_path(directory, instance_id)
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self._mapping = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only memory: the decode only ever copies out of it
            warnings.simplefilter("ignore", UserWarning)
            self._tensor = torch.frombuffer(self._mapping, dtype=torch.uint8)

    def region(self, offset: int, num_bytes: int) -> torch.Tensor:
        """The bytes ``[offset, offset + num_bytes)``; ValueError when they are not inside the arena."""
        if offset < 0 or num_bytes < 0 or offset + num_bytes > self.size:
            raise ValueError(f"region [{offset}, {offset + num_bytes}) is outside the {self.size}-byte arena")
        return self._tensor.narrow(0, offset, num_bytes)


def sweep(directory: Path) -> int:
    """Removes the arenas of prefills that died, and the lock files of every process that died;
    returns how many arenas went."""
    try:
        names = [p.name for p in directory.iterdir()]
    except OSError:
        return 0
    instances = {
        name[len(PREFIX) : -len(suffix)]
        for name in names
        for suffix in (ARENA_SUFFIX, LOCK_SUFFIX)
        if name.startswith(PREFIX) and name.endswith(suffix)
    }
    dead = {i for i in instances if is_instance_id(i) and not is_alive(directory, i)}
    removed = 0
    for instance in dead:
        with contextlib.suppress(OSError):
            arena_path(directory, instance).unlink()
            removed += 1
        with contextlib.suppress(OSError):
            lock_path(directory, instance).unlink()
    if removed:
        logger.warning("removed %d KV arenas left in %s by prefills that died", removed, directory)
    return removed


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
