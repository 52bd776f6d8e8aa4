"""KVs lent to decodes of the same host, which read them in place (``shm``, ``cuda-ipc``).

Lifecycle of a lent KV:
1. a decode takes it (PullKvMany over a same-host transport): it leaves the registry and is lent
   to that decode, with where to read it (its arena offset, or its exported GPU memory);
2. the decode copies it into its pool and gives it back (ReleaseKv): its memory is freed;
3. a KV lent to a decode that died is freed at the next ``reclaim`` (the decode's instance lock
   is free); one never given back by a live decode stays lent, bounded by what that decode holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from pdserve.kv import cuda_ipc
from pdserve.kv.transports import CUDA_IPC, SHM
from pdserve.v1 import kv_pb2
from prefill_service.kv_registry import ParkedKv

logger = logging.getLogger(__name__)


class KvLender:
    def __init__(self, is_alive: Callable[[str], bool]) -> None:
        self._is_alive = is_alive
        self._lent: dict[bytes, tuple[ParkedKv, str]] = {}  # handle id -> (KV, decode instance)
        self._lock = threading.Lock()

    @property
    def num_lent(self) -> int:
        return len(self._lent)

    @property
    def num_bytes_lent(self) -> int:
        with self._lock:
            return sum(entry.num_bytes for entry, _ in self._lent.values())

    def lend(
        self, entries: Sequence[ParkedKv], decode_instance_id: str, transport: str
    ) -> list[kv_pb2.LentKv]:
        """Lends taken KVs to a decode; where it reads each one, in order."""
        where = [self._where(entry, transport) for entry in entries]
        with self._lock:
            for entry in entries:
                self._lent[entry.handle_id] = (entry, decode_instance_id)
        return where

    def give_back(self, handle_id: bytes) -> bool:
        with self._lock:
            lent = self._lent.pop(handle_id, None)
        if lent is None:
            return False
        lent[0].free()
        return True

    def reclaim(self) -> int:
        """Frees what is lent to decodes that died; returns how many KVs."""
        with self._lock:
            decodes = {decode for _, decode in self._lent.values()}
        dead = {decode for decode in decodes if not self._is_alive(decode)}
        if not dead:
            return 0
        with self._lock:
            gone = [hid for hid, (_, decode) in self._lent.items() if decode in dead]
            entries = [self._lent.pop(hid)[0] for hid in gone]
        for entry in entries:
            entry.free()
        logger.warning("freed %d KVs lent to %d decodes that died", len(entries), len(dead))
        return len(entries)

    def close(self) -> None:
        with self._lock:
            entries = [entry for entry, _ in self._lent.values()]
            self._lent.clear()
        for entry in entries:
            entry.free()

    @staticmethod
    def _where(entry: ParkedKv, transport: str) -> kv_pb2.LentKv:
        if transport == SHM:
            if entry.arena_offset is None:
                raise ValueError("a KV outside the shared-memory arena cannot be lent over shm")
            return kv_pb2.LentKv(offset=entry.arena_offset)
        if transport == CUDA_IPC:
            return kv_pb2.LentKv(cuda_ipc=cuda_ipc.export(entry.buffer))
        raise ValueError(f"{transport!r} is not a same-host transport")
