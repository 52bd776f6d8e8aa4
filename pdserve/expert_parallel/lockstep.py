"""Every rank of an expert-parallel group runs one forward per tick, in step with the others.

A MoE forward exchanges tokens with every other rank in each MoE layer, so all ranks must run a
forward together. Engines hand their forwards to ``run`` (from their own threads) and wait; the
lockstep thread, once per tick:
1. all-reduces (max) four numbers over the group: "I have a forward", "I am stopping", what the
   rank's service still holds (``track_busy``: parked KV, sends in flight), so rank 0's drain can
   wait for every rank's (``group_busy``), and the tokens of the rank's forward (1 for a filler,
   ``UNKNOWN_TOKENS`` when ``run`` was not told), handed to ``on_tick`` before the forward runs so
   that every rank picks the same dispatch kernels (``dispatch_choice``);
2. if any rank stops, every rank leaves the loop (the group ends together);
3. if no rank has work, rank 0 waits a little (backing off up to ``IDLE_SLEEP_MAX_S``, cut short
   when a forward of its own arrives) while the others go straight into the next tick's exchange
   and wait there without using the CPU: an idle group ticks at most every ``IDLE_SLEEP_MAX_S``;
4. otherwise every rank runs one forward: its own, or a one-token filler that only takes part in
   the exchanges (a rank without requests at this step).
Any failure (a rank died, a collective timed out, a forward raised: the group is no longer in step)
breaks the lockstep for good once the forward's own waits give up (``--ep-timeout-s`` for gloo and
NCCL, DeepEP's compile-time 100 s for its kernels): waiting and later forwards raise ``ForwardUnavailable`` and
``ended`` is set, so the service reports NOT_SERVING and fails its requests instead of hanging.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from pdserve.expert_parallel.dispatch_choice import UNKNOWN_TOKENS
from pdserve.model.engine_model import ForwardUnavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")
Job = tuple[Callable[[], Any], "concurrent.futures.Future[Any]", int]
IDLE_SLEEP_MIN_S = 0.0005
IDLE_SLEEP_MAX_S = 0.02


class Lockstep:
    def __init__(
        self,
        filler: Callable[[], Any],
        device: torch.device,
        leader: bool,
        on_tick: Callable[[int], None] = lambda tokens: None,
    ) -> None:
        self._filler = filler
        self._device = device
        self._leader = leader  # rank 0 paces the idle ticks
        self._on_tick = on_tick
        self._wake = threading.Event()
        self._busy: Callable[[], int] = lambda: 0
        self.group_busy = 0  # the most any rank held at the last tick
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self.ended = threading.Event()
        self.failure: BaseException | None = None
        self.ticks = 0
        self.fillers = 0
        self._thread = threading.Thread(target=self._loop, name="ep-lockstep", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the loop on every rank of the group at the next tick."""
        self._stopping.set()
        self._wake.set()

    def track_busy(self, busy: Callable[[], int]) -> None:
        """What this rank's service still holds, reported to the group at every tick."""
        self._busy = busy

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    @property
    def broken(self) -> bool:
        return self.failure is not None

    def run(self, fn: Callable[[], T], num_tokens: int = UNKNOWN_TOKENS) -> T:
        """Runs ``fn`` (one model forward of ``num_tokens`` tokens) at the next tick of the group;
        blocks until it ends."""
        if self.ended.is_set():
            raise ForwardUnavailable(self._why())
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((fn, future, num_tokens))
        self._wake.set()
        if self.ended.is_set():
            self._fail_queued()
        return future.result()

    def _why(self) -> str:
        if self.failure is not None:
            return f"the expert-parallel group failed: {self.failure}"
        return "the expert-parallel group stopped"

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        idle_sleep = IDLE_SLEEP_MIN_S
        job: Job | None = None
        try:
            while True:
                if job is None:
                    job = self._next_job()
                tokens = job[2] if job is not None else 1
                flags = torch.tensor(
                    [int(job is not None), int(self._stopping.is_set()), self._busy(), tokens],
                    dtype=torch.int64,
                )
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                self.group_busy = int(flags[2])
                if flags[1]:
                    break
                if not flags[0]:
                    if self._leader:
                        self._wake.wait(idle_sleep)
                        self._wake.clear()
                        idle_sleep = min(idle_sleep * 2, IDLE_SLEEP_MAX_S)
                    continue
                idle_sleep = IDLE_SLEEP_MIN_S
                self.ticks += 1
                self._on_tick(int(flags[3]))
                if job is None:
                    self.fillers += 1
                    self._filler()
                    continue
                fn, future, _ = job
                job = None
                try:
                    result = fn()
                except BaseException as exc:
                    future.set_exception(ForwardUnavailable(f"forward failed: {exc}"))
                    raise
                future.set_result(result)
        except BaseException as exc:
            self.failure = exc
            logger.error("expert-parallel lockstep failed: %s", exc)
        finally:
            self.ended.set()
            if job is not None and not job[1].done():
                job[1].set_exception(ForwardUnavailable(self._why()))
            self._fail_queued()

    def _next_job(self) -> Job | None:
        try:
            return self._jobs.get_nowait()
        except queue.Empty:
            return None

    def _fail_queued(self) -> None:
        while (job := self._next_job()) is not None:
            if not job[1].done():
                job[1].set_exception(ForwardUnavailable(self._why()))
