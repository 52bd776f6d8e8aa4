"""KVs lent to decodes of the same host, which read them in place (``shm``, ``cuda-ipc``).

Lifecycle of a lent KV:
1. a decode takes it (PullKvMany over a same-host transport): it leaves the registry and is lent
   to that decode's link (its instance id and pair secret, ``pdserve.kv.pair_secret``), with where
   to read it (its arena offset, or its exported GPU memory);
2. the decode copies it into its pool and gives it back (ReleaseKv with the same instance id and
   secret; a release by anyone else leaves it lent): its memory is freed;
3. a KV lent to a decode that died is freed at the next ``reclaim`` (the decode's instance lock
   is free); one never given back by a live decode stays lent, bounded by what that decode holds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from pdserve.kv import cuda_ipc
from pdserve.kv.pair_secret import PairKey
from pdserve.kv.transports import CUDA_IPC, SHM
from pdserve.v1 import kv_pb2
from prefill_service.kv_registry import ParkedKv

logger = logging.getLogger(__name__)


class KvLender:
    def __init__(self, is_alive: Callable[[str], bool]) -> None:
        self._is_alive = is_alive
        self._lent: dict[bytes, tuple[ParkedKv, PairKey]] = {}  # handle id -> (KV, the decode's link)
        self._lock = threading.Lock()

    @property
    def num_lent(self) -> int:
        return len(self._lent)

    @property
    def num_bytes_lent(self) -> int:
        with self._lock:  # a buffer lent under several handles (choices of one request) counts once
            return sum({id(entry.buffer): entry.num_bytes for entry, _ in self._lent.values()}.values())

    def lend(self, entries: Sequence[ParkedKv], owner: PairKey, transport: str) -> list[kv_pb2.LentKv]:
        """Lends taken KVs to a decode's link; where it reads each one, in order."""
        where = [self._where(entry, transport) for entry in entries]
        with self._lock:
            for entry in entries:
                self._lent[entry.handle_id] = (entry, owner)
        return where

    def give_back(self, handle_id: bytes, owner: PairKey) -> bool:
        """Frees a lent KV given back by the link it was lent to (False otherwise)."""
        with self._lock:
            lent = self._lent.get(handle_id)
            if lent is None or lent[1] != owner:
                return False
            del self._lent[handle_id]
        lent[0].free()
        return True

    def reclaim(self) -> int:
        """Frees what is lent to decodes that died; returns how many KVs."""
        with self._lock:
            decodes = {owner[0] for _, owner in self._lent.values()}
        dead = {decode for decode in decodes if not self._is_alive(decode)}
        if not dead:
            return 0
        with self._lock:
            gone = [hid for hid, (_, owner) in self._lent.items() if owner[0] in dead]
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
