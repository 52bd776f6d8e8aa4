"""Runs a prefill, decode or colocated service as an expert-parallel group of ``--ep`` ranks.

Every rank loads the model on the CPU, keeps its own experts, moves them to its device, builds the
service's real parts (engines, registry, puller...) and serves them on an internal gRPC server of
its own; its forwards run in lockstep with the other ranks. Rank 0 also serves the public address:
health, reflection and the routers that hand each call to a rank (``rank_router``). Its ready line
lists every rank and the dispatch kernels the group runs (``ep_dispatch``).

Once the process group has formed and before the lockstep starts, the ranks choose their dispatch
together (``expert_parallel.deepep_setup``): DeepEP's kernels when they import, fit the group and
pass a start-up round trip, the all-to-all otherwise. A DeepEP start-up error ends every rank with
exit status 2 before the group reports ready.

Every rank warms up its engines once the lockstep runs, before rank 0 announces ready (it waits for
every rank's mark): with ``--compile`` their forwards compile, and a prefill on the CPU times the
forwards that measure its forward size's fixed cost (``prefill_service/forward_size.py``; in the
group, what a forward waits for the other ranks counts in it). Each of these forwards is one of the
rank's forwards at a tick of the group; a rank with none of its own at that tick runs the filler,
so the ranks stay in step whatever each of them runs.

Ends:
- SIGTERM/SIGINT on rank 0: the public server drains (calls in flight, on any rank, finish), then
  the lockstep stops on every rank, and every process exits 0;
- a rank dies or a group wait times out: the lockstep breaks on the others once their wait gives up;
  every forward waiting or to come fails (their calls end with UNAVAILABLE), rank 0 reports
  NOT_SERVING for the grace period, and every process exits 1 so its supervisor starts the group
  again. A rank lost between ticks is noticed at the next tick's gloo exchange (at once, or within
  ``--ep-timeout-s``). One lost in the middle of a forward leaves the others inside that forward's
  exchanges: gloo and NCCL give up after ``--ep-timeout-s`` (what NCCL's watchdog then does is set
  by ``TORCH_NCCL_ASYNC_ERROR_HANDLING``); DeepEP's kernels have no run-time timeout and wait up to
  their compile-time bound, about 100 s (``NUM_TIMEOUT_CYCLES``/``NUM_CPU_TIMEOUT_SECS`` in its
  ``csrc/kernels/configs.cuh``), then trap, which leaves that process's CUDA context unusable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from typing import Any

import torch

from pdserve.core.heap import freeze_heap
from pdserve.expert_parallel.deepep_setup import DeepEpRequest, DeepEpSetup, DeepEpStartError
from pdserve.expert_parallel.ep_metrics import register_ep_metrics
from pdserve.expert_parallel.group import EpGroup, internal_port
from pdserve.expert_parallel.lockstep import Lockstep
from pdserve.expert_parallel.rank_model import ExpertSharding, RankModel, expert_parallel_model
from pdserve.hosting.rank_router import DecodeRouter, PrefillRouter, RankChannels
from pdserve.hosting.service_kind import RankParts, ServiceKind
from pdserve.model.engine_model import ForwardUnavailable, load_engine_model
from pdserve.rpc.server import ServiceServer, announce_ready
from pdserve.rpc.service_security import internal_client
from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc

logger = logging.getLogger(__name__)

LOCKSTEP_POLL_S = 0.05
JOIN_TIMEOUT_S = 30.0


async def serve_group(kind: ServiceKind, config: Any) -> None:
    engine = config.engine
    server_config = config.server
    rank = engine.ep_rank
    if rank:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is rank 0's to handle
    if rank == 0:
        group = await asyncio.to_thread(
            EpGroup.lead, kind.command, kind.config_cls, config, server_config.host
        )
    else:
        group = await asyncio.to_thread(EpGroup.join, engine)
    failed = True
    try:
        failed = await _serve_rank(kind, config, group)
    finally:
        await asyncio.to_thread(group.close)
    if failed:
        raise SystemExit(1)


async def _warm_up(parts: RankParts, group: EpGroup, lockstep: Lockstep, stop: asyncio.Event) -> None:
    """Warms up this rank's engines; rank 0 then waits until every rank has (or the group ended)."""
    with contextlib.suppress(ForwardUnavailable):  # the group broke: the caller sees lockstep.ended
        await asyncio.to_thread(parts.warm_up)
        group.mark_warm()
    if group.rank == 0:
        while not group.all_warm() and not lockstep.ended.is_set() and not stop.is_set():
            await asyncio.sleep(LOCKSTEP_POLL_S)


def _choose_dispatch(kind: ServiceKind, config: Any, rank_model: RankModel) -> str:
    """Every rank at once, before the lockstep starts: DeepEP's kernels or the all-to-all."""
    engine_model = rank_model.engine_model
    if engine_model.device.type == "cuda":
        torch.cuda.set_device(engine_model.device)  # per thread: DeepEP makes its buffers on the current GPU
    hf_config = engine_model.model.config
    request = DeepEpRequest(
        shard=rank_model.shard,
        hidden=int(hf_config.hidden_size),
        top_k=int(hf_config.num_experts_per_tok),
        dtype=engine_model.model.dtype,
        device=engine_model.device,
        low_latency_tokens=int(config.max_running) if kind.routes_decode else 0,
        mode=config.engine.ep_dispatch,
    )
    return DeepEpSetup().run(request, rank_model.dispatch)


async def _serve_rank(kind: ServiceKind, config: Any, group: EpGroup) -> bool:
    """Serves until the group ends; True when it ended by failure."""
    rank = await _RankRun.start(kind, config, group)
    try:
        await rank.join_group()
        await rank.serve_public()
        return await rank.wait_for_end()
    finally:
        await rank.close()


class _RankRun:
    """One rank of a running group: its model, its service on an internal port, and on rank 0 the
    public port with the routers."""

    def __init__(
        self,
        kind: ServiceKind,
        config: Any,
        group: EpGroup,
        rank_model: Any,
        parts: RankParts,
        internal: ServiceServer,
    ) -> None:
        self.kind, self.config, self.group = kind, config, group
        self.rank_model = rank_model
        self.parts = parts
        self.internal = internal
        self.lockstep: Lockstep = rank_model.lockstep
        self.public: ServiceServer | None = None
        self.ranks: RankChannels | None = None
        self.infos: list[dict[str, Any]] = []
        self.kernels = ""
        self.stop = asyncio.Event()
        self.metrics_servers = parts.serve_metrics(config.server.host)
        self.tasks: list[asyncio.Task[None]] = []
        # Rank 0 drains on SIGTERM or SIGINT; the others leave SIGINT (a terminal's Ctrl-C) to rank 0.
        self.signals = (signal.SIGTERM, signal.SIGINT) if group.rank == 0 else (signal.SIGTERM,)

    @classmethod
    async def start(cls, kind: ServiceKind, config: Any, group: EpGroup) -> _RankRun:
        """Loads this rank's part of the model and serves its parts on the internal port."""
        sharding = ExpertSharding(group.rank, group.size)
        try:
            loaded = await asyncio.to_thread(load_engine_model, config.engine, sharding)
            rank_model = expert_parallel_model(loaded, sharding)
        except ValueError as exc:  # the model cannot be split this way: a usage error, not a crash
            logger.error("pdserve %s --ep %d: %s", kind.command, group.size, exc)
            raise SystemExit(2) from None
        # Rank 0's public port is for its routers; every rank serves its parts on an internal port.
        internal = kind.server(config, internal_port(config.engine))
        parts = kind.build(config, rank_model.engine_model, internal, group.rank)
        rank_model.lockstep.track_busy(parts.busy)
        register_ep_metrics(
            parts.metrics[0][1], group.rank, group.size, rank_model.lockstep, rank_model.dispatch
        )
        run = cls(kind, config, group, rank_model, parts, internal)
        await internal.start()
        run.tasks = [asyncio.create_task(task()) for task in parts.background]
        loop = asyncio.get_running_loop()
        for sig in run.signals:
            loop.add_signal_handler(sig, run.stop.set)
        return run

    @property
    def info(self) -> dict[str, Any]:
        host = self.config.server.public_host
        return {
            "rank": self.group.rank,
            "pid": os.getpid(),
            "grpc": self.internal.address,
            **{key: f"{host}:{server.port}" for key, server in self.metrics_servers.items()},
            **self.parts.ready,
        }

    async def join_group(self) -> None:
        """Every rank published, the process group formed, the dispatch chosen, the lockstep
        running, every rank warm (compiled with ``--compile``, a prefill's forward size measured),
        and its start-up heap out of the garbage collector."""
        group = self.group
        group.publish(self.info)
        if group.rank == 0:
            self.infos = await asyncio.to_thread(group.gather)
        else:
            await asyncio.to_thread(group.wait_for_go)
        await asyncio.to_thread(group.form, self.rank_model.engine_model.device)
        try:
            self.kernels = await asyncio.to_thread(_choose_dispatch, self.kind, self.config, self.rank_model)
        except DeepEpStartError as exc:
            logger.error("pdserve %s --ep %d: %s", self.kind.command, group.size, exc)
            raise SystemExit(2) from None
        self.lockstep.start()
        logger.info("expert-parallel rank %d of %d in step", group.rank, group.size)
        await _warm_up(self.parts, group, self.lockstep, self.stop)
        self.rank_model.engine_model.end_warm_ups(self.config.engine.recompile_in_serving)
        freeze_heap(f"{self.kind.command} rank {group.rank}")

    async def serve_public(self) -> None:
        """Rank 0: the public port with the routers, and the group's ready line."""
        if self.group.rank != 0:
            return
        kind = self.kind
        self.public = public = kind.server(self.config, self.config.server.port)
        self.ranks = ranks = RankChannels(
            [i["grpc"] for i in self.infos], internal_client(self.config.security)
        )
        if kind.routes_prefill:
            prefill_pb2_grpc.add_PrefillServicer_to_server(PrefillRouter(ranks), public.server)
        if kind.routes_decode:
            decode_pb2_grpc.add_DecodeServicer_to_server(
                DecodeRouter(ranks, kind.decode_by_handle_rank), public.server
            )
        await public.start()
        own = {k: v for k, v in self.info.items() if k not in ("rank", "pid", "grpc")}
        announce_ready(kind.command, grpc=public.address, **own, ep_dispatch=self.kernels, ranks=self.infos)

    async def wait_for_end(self) -> bool:
        """Until a signal (drain, then stop the group) or the group's end; True when it failed."""
        while not self.stop.is_set() and not self.lockstep.ended.is_set():
            await asyncio.sleep(LOCKSTEP_POLL_S)
        grace_s = self.config.server.grace_s
        if self.stop.is_set():
            if self.public is not None:
                logger.info("draining expert-parallel %s (grace %.1fs)", self.kind.command, grace_s)
                # Waits for what every rank holds: a decode pulls KV from the rank that parked it.
                await self.public.drain(
                    grace_s, busy=lambda: max(self.parts.busy(), self.lockstep.group_busy)
                )
            self.lockstep.stop()  # on a rank other than 0, this stops the whole group
            await asyncio.to_thread(self.lockstep.join, JOIN_TIMEOUT_S)
            return False
        failed = self.lockstep.failure is not None
        logger.log(
            logging.ERROR if failed else logging.INFO,
            "expert-parallel group ended: %s",
            self.lockstep.failure or "stopped by another rank",
        )
        if self.public is not None:
            await self.public.fail(grace_s)
        return failed

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.signals:
            loop.remove_signal_handler(sig)
        self.lockstep.stop()
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.ranks is not None:
            await self.ranks.close()
        await self.internal.server.stop(0)
        await self.parts.close()
        for server in self.metrics_servers.values():
            server.close()
