"""A decode's link to one prefill of the same host (``shm``, ``cuda-ipc``): KV read in place.

One fetch, under the link's lock (the puller holds it):
1. PullKvMany over the link's transport: the prefill takes the KVs out of its registry and lends
   them to this decode, answering where each one is (an offset in its shared-memory arena, or its
   exported GPU memory);
2. each lent KV becomes a tensor over the prefill's memory: a region of this decode's read-only
   mapping of the arena (made once per prefill), or the opened CUDA IPC buffer;
3. the decode copies it once into its pool, then gives it back (``give_back``: ReleaseKv) so the
   prefill frees it.
Nothing is sent, so there is no pair and no generation; the prefill frees what it lent to this
decode if the decode dies (it watches the decode's instance lock). The link's secret
(``pdserve.kv.pair_secret``) goes with its pull and release calls: what is lent to it is given back
only by it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import grpc
import torch

from decode_service.metrics import DecodeMetrics
from pdserve.kv import cuda_ipc
from pdserve.kv.pair_secret import new_pair_secret
from pdserve.kv.shared_memory import ArenaReader
from pdserve.kv.transports import SHM, Place
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc

logger = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 5.0
RELEASE_ATTEMPTS = 6


class LocalLink:
    def __init__(
        self,
        instance_id: str,
        prefill_instance_id: str,
        stub: prefill_pb2_grpc.PrefillStub,
        transport: str,
        place: Place,
        remote: Place,
        shm_dir: Path,
        timeout: timedelta,
        metrics: DecodeMetrics,
    ) -> None:
        self._instance_id = instance_id
        self._prefill_instance_id = prefill_instance_id
        self._stub = stub
        self._secret = new_pair_secret()
        self.transport = transport
        self._place = place
        self._remote = remote
        self._shm_dir = shm_dir
        self._timeout = timeout
        self._metrics = metrics
        self._arena: ArenaReader | None = None
        self._releases: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()  # made on the event loop; given back from any thread
        self.borrowed = 0

    async def fetch(self, handles: Sequence[kv_pb2.KvHandle]) -> list[torch.Tensor | None]:
        """Per handle, a tensor over the prefill's memory holding its KV (lent to this decode until
        ``give_back``), or None when the prefill does not hold it."""
        response = await self._stub.PullKvMany(
            prefill_pb2.PullKvManyRequest(
                handle_ids=[h.id for h in handles],
                decode_instance_id=self._instance_id,
                transport=self.transport,
                pair_secret=self._secret,
            ),
            timeout=self._timeout.total_seconds(),
        )
        sizes = list(response.num_bytes)
        lent = list(response.lent) or [kv_pb2.LentKv()] * len(handles)
        if len(sizes) != len(handles) or len(lent) != len(handles):
            raise ValueError("the prefill answered for another number of handles")
        out: list[torch.Tensor | None] = []
        for handle, size, where in zip(handles, sizes, lent, strict=True):
            if not size:
                out.append(None)
                continue
            self.borrowed += 1
            try:
                if size != handle.num_bytes:
                    raise ValueError(f"the prefill lends {size} bytes, {handle.num_bytes} expected")
                out.append(self._open(where, size))
            except Exception:
                self._give_back(handle.id)
                raise
        return out

    def give_back(self, handle: kv_pb2.KvHandle) -> None:
        """Tells the prefill this decode is done with a lent KV (in the background; any thread)."""
        try:
            self._loop.call_soon_threadsafe(self._give_back, handle.id)
        except RuntimeError:  # the loop is closed: the prefill frees it when this decode is gone
            logger.debug("lent KV %s not given back: the event loop is closed", handle.id.hex())

    def _give_back(self, handle_id: bytes) -> None:
        self.borrowed -= 1
        task = self._loop.create_task(self._release(handle_id))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def close(self) -> None:
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)

    def _open(self, where: kv_pb2.LentKv, num_bytes: int) -> torch.Tensor:
        if self.transport == SHM:
            if self._arena is None:
                self._arena = ArenaReader(self._shm_dir, self._prefill_instance_id)
            return self._arena.region(where.offset, num_bytes)
        message = where.cuda_ipc
        if message.num_bytes != num_bytes:
            raise ValueError("the exported GPU memory is not the KV's size")
        return cuda_ipc.open_buffer(message, self._local_index(message))

    def _local_index(self, message: kv_pb2.CudaIpcBuffer) -> int:
        """The index under which this process sees the GPU holding an exported buffer."""
        remote = self._remote.device_uuid
        if remote and remote in self._place.visible_gpus:
            return self._place.visible_gpus.index(remote)
        return int(message.device_index)

    async def _release(self, handle_id: bytes) -> None:
        """Gives a lent KV back, again after a failed call (a busy prefill must not keep it lent)."""
        request = prefill_pb2.ReleaseKvRequest(
            handle_id=handle_id, decode_instance_id=self._instance_id, pair_secret=self._secret
        )
        for attempt in range(RELEASE_ATTEMPTS):
            try:
                await self._stub.ReleaseKv(request, timeout=RELEASE_TIMEOUT_S)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    break
                logger.info("giving back lent KV %s: %s; again", handle_id.hex(), exc.code().name)
                await asyncio.sleep(0.1 * 2**attempt)
        logger.warning(
            "lent KV %s could not be given back; its prefill frees it once this decode stops", handle_id.hex()
        )
