"""One side of a 2-rank torch.distributed group between one prefill and one decode process.

The same code serves gloo (CPU tensors) and NCCL (CUDA tensors): the backend and device are
parameters. Rank 0 is the prefill, rank 1 the decode. Each channel owns one worker thread, and
every operation (the group's construction first, then each send or receive) runs on it in
submission order: NCCL has no tags, so both sides keep the order in which the decode asked for
transfers. Every wait is bounded by the channel timeout; after any failure the channel is broken
and its owner builds a new one under a new generation (a fresh store prefix).

Under gloo a pair's group has ``GLOO_STREAMS`` connections (one gloo device, so one socket and
one I/O thread, each): a buffer of at least two ``MIN_CHUNK_BYTES`` is cut into as many chunks as
fit (at most one per connection), each chunk goes over its own connection under its own tag, and
the operation ends when every chunk has. One TCP stream over loopback moves far less than the
memory bus does; several in parallel move more. Both sides cut a buffer of a given size the same
way, and an operation ends before the next one starts, so order holds per pair as before.

Lifecycle of a channel: created (nothing connected) -> connecting (on the first operation, both
sides rendezvous through the prefill's TCPStore) -> ready -> broken or closed. Closing drops the
group on the worker thread once the operation in progress ends, and the thread then exits, so a
closed or broken channel holds neither sockets nor a thread. ``num_pending`` counts operations
posted and not yet ended, and ``transfer_threads()`` the worker threads alive in the process: with
no transfer in progress the second equals the number of open channels.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PREFILL_RANK = 0
DECODE_RANK = 1
THREAD_NAME_PREFIX = "kv-pair-"
# Connections of one gloo pair, and the smallest chunk worth a connection of its own. Both sides of
# a pair must use the same values (they decide how a buffer is cut).
GLOO_STREAMS = 4
MIN_CHUNK_BYTES = 1 << 20


class ChannelState(enum.Enum):
    CREATED = "created"
    CONNECTING = "connecting"
    READY = "ready"
    BROKEN = "broken"
    CLOSED = "closed"


class TransferError(RuntimeError):
    """A transfer failed or timed out; the channel that ran it is broken."""


def transfer_device(backend: str, device: torch.device) -> torch.device:
    """Where transfer buffers live: the engine's CUDA device for NCCL, host memory for gloo."""
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError(f"the nccl backend needs a CUDA device, got {device}")
        if device.index is None:  # one name per device: buffers report cuda:N
            return torch.device("cuda", torch.cuda.current_device())
        return device
    if backend == "gloo":
        return torch.device("cpu")
    raise ValueError(f"unknown KV backend {backend!r}")


def chunks(buf: torch.Tensor, streams: int) -> list[torch.Tensor]:
    """How a flat buffer is cut for ``streams`` connections: views, in order, covering it once."""
    count = max(1, min(streams, buf.numel() // MIN_CHUNK_BYTES))
    return list(buf.tensor_split(count)) if count > 1 else [buf]


def transfer_threads() -> int:
    """Worker threads of channels alive in this process (open channels, or closed ones still ending)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX))


class PairChannel:
    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        backend: str,
        device: torch.device,
        local_host: str,
        timeout: timedelta,
        build_group: Callable[[], Any] | None = None,
    ) -> None:
        """``build_group`` replaces the real torch.distributed group (tests use a stand-in)."""
        self.prefix = prefix
        self.rank = rank
        self.backend = backend
        self.device = transfer_device(backend, device)
        self._store = store
        self._local_host = local_host
        self._timeout = timeout
        self._group: Any = None
        self._build = build_group or self._build_group
        self._lock = threading.Lock()
        self._executor_closed = False
        self._state = ChannelState.CREATED
        self._pending = 0
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=THREAD_NAME_PREFIX + prefix.strip("/").replace("/", "-")
        )

    @property
    def state(self) -> ChannelState:
        return self._state

    @property
    def is_usable(self) -> bool:
        return self._state in (ChannelState.CREATED, ChannelState.CONNECTING, ChannelState.READY)

    @property
    def peer(self) -> int:
        return 1 - self.rank

    @property
    def num_pending(self) -> int:
        """Operations posted and not yet ended (queued or waiting)."""
        return self._pending

    def connect(self) -> concurrent.futures.Future[None]:
        """Builds the group (both sides must call it, or post a transfer) without moving any data."""
        return self._submit("connect", None)

    def send(self, buf: torch.Tensor) -> concurrent.futures.Future[None]:
        """Posts the send of ``buf`` after every earlier operation of this channel."""
        return self._submit("send", buf)

    def recv(self, buf: torch.Tensor) -> concurrent.futures.Future[None]:
        """Posts the receive into ``buf`` after every earlier operation of this channel."""
        return self._submit("recv", buf)

    def close(self) -> None:
        """Stops taking operations; a wait in progress ends at its timeout at the latest, then the
        group is dropped and the worker thread exits."""
        with self._lock:
            if self._state != ChannelState.BROKEN:
                self._state = ChannelState.CLOSED
            closed_before = self._executor_closed
            self._executor_closed = True
            idle = self._pending == 0 and self._group is None
        if closed_before:
            return
        if not idle:
            # Queued operations fail fast with TransferError; the teardown runs after them.
            self._executor.submit(self._drop_group)
        self._executor.shutdown(wait=False)

    def _drop_group(self) -> None:
        self._release_group(broken=False)

    def _release_group(self, broken: bool) -> None:
        """Ends the group explicitly: shut down after a clean close, aborted after a failure (NCCL's
        communicators go at once instead of at garbage collection, with the GIL held)."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            group.abort() if broken else group.shutdown()
        except Exception as exc:
            logger.debug("ending the group of %s: %s", self.prefix, exc)

    def _advance(self, state: ChannelState) -> None:
        with self._lock:
            if not self.is_usable:
                raise TransferError(f"channel {self.prefix} is {self._state.value}")
            self._state = state

    def _submit(self, op: str, buf: torch.Tensor | None) -> concurrent.futures.Future[None]:
        if buf is not None and buf.device != self.device:
            raise ValueError(f"{op} buffer is on {buf.device}, the channel moves {self.device} tensors")
        if buf is not None and not buf.is_contiguous():
            raise ValueError(f"{op} buffer must be contiguous")
        with self._lock:
            if not self.is_usable:
                raise TransferError(f"channel {self.prefix} is {self._state.value}")
            self._pending += 1
            try:
                return self._executor.submit(self._run, op, buf)
            except RuntimeError:
                self._pending -= 1
                raise TransferError(f"channel {self.prefix} is {self._state.value}") from None

    def _run(self, op: str, buf: torch.Tensor | None) -> None:
        try:
            self._run_op(op, buf)
        finally:
            with self._lock:
                self._pending -= 1

    def _run_op(self, op: str, buf: torch.Tensor | None) -> None:
        if not self.is_usable:
            raise TransferError(f"channel {self.prefix} is {self._state.value}")
        try:
            if self._group is None:
                self._advance(ChannelState.CONNECTING)
                self._group = self._build()
                self._advance(ChannelState.READY)
            if buf is None:
                return
            self._wait(op, buf, self._post(op, buf))
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except Exception as exc:
            with self._lock:
                if self._state != ChannelState.CLOSED:
                    self._state = ChannelState.BROKEN
            self._release_group(broken=True)  # a broken group is never used again: free it now
            logger.warning("KV %s on %s failed: %s", op, self.prefix, exc)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"{op} on {self.prefix} failed: {exc}") from exc

    def _post(self, op: str, buf: torch.Tensor) -> list[Any]:
        """Posts every chunk of ``buf``: chunk i under tag i, so on connection i."""
        parts = chunks(buf, GLOO_STREAMS) if self.backend == "gloo" else [buf]
        if op == "send":
            return [self._group.send([part], self.peer, tag) for tag, part in enumerate(parts)]
        return [self._group.recv([part], self.peer, tag) for tag, part in enumerate(parts)]

    def _wait(self, op: str, buf: torch.Tensor, works: list[Any]) -> None:
        """Waits for every posted chunk, within one timeout."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        try:
            for work in works:
                # At least 1 ms: a zero timeout means "no timeout" to torch.distributed.
                left = timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
                if not work.wait(left):
                    raise TransferError(f"{op} of {buf.numel()} bytes timed out after {self._timeout}")
        finally:
            works.clear()  # a failure's traceback must not keep the group's sockets alive

    def _build_group(self) -> Any:
        # A connection of its own: a TCPStore client runs one call at a time, and the rendezvous
        # waits for the peer's keys, so a shared one would hold every other pair's build up.
        # A store written in Python (``RelayStore``) adds the prefix itself: torch's PrefixStore
        # cannot wrap one.
        prefixed = getattr(self._store, "prefixed", None)
        if prefixed is not None:
            store = prefixed(self.prefix)
        else:
            clone = getattr(self._store, "clone", None)
            store = dist.PrefixStore(self.prefix, clone() if clone is not None else self._store)
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = self._timeout
            return dist.ProcessGroupNCCL(store, self.rank, 2, nccl_opts)
        gloo_opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        if self._local_host in ("", "0.0.0.0", "::"):
            devices = [dist.ProcessGroupGloo.create_default_device() for _ in range(GLOO_STREAMS)]
        else:
            devices = [
                dist.ProcessGroupGloo.create_device(hostname=self._local_host) for _ in range(GLOO_STREAMS)
            ]
        gloo_opts._devices = devices
        gloo_opts._timeout = self._timeout
        return dist.ProcessGroupGloo(store, self.rank, 2, gloo_opts)
