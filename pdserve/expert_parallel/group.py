"""The rank processes of one expert-parallel service and the torch.distributed group they form.

Rank 0 is the process the user started: it hosts the group's TCPStore and starts ranks 1..N-1 as
child processes of the same command (same flags, with ``--ep-rank``/``--ep-master`` and ports of
their own: free ones, or those of ``--ep-port-base``, see ``pdserve.config.ep_ports``). They stay in rank 0's process group (a supervisor that kills it kills them all), get
SIGTERM if rank 0 dies, and ignore SIGINT: a terminal's Ctrl-C is rank 0's to handle, which then
drains and stops the whole group. Start-up, on every rank:
1. load the model, keep its own experts, build its services and start its (internal) gRPC server;
2. publish its addresses under ``rank/<r>`` in the store; rank 0 waits for every rank (watching
   that none exited), then publishes ``go``; the others wait for it;
3. all ranks form the process group at once (gloo on CPU; gloo for CPU tensors and NCCL for CUDA
   tensors on GPUs), so its bounded waits (``--ep-timeout-s``) never cover a model load;
4. every rank warms up its compiled forwards (``--compile``) and marks it under ``warm/<r>``;
   rank 0 announces the group ready once every rank has.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pdserve.config import EngineConfig, flags
from pdserve.config.ep_ports import ep_rank_ports
from pdserve.core.processes import with_parent_death_signal
from pdserve.kv.rendezvous import connect_store, host_store

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0
POLL_S = 0.5


def rank_port_overrides(base: int, rank: int) -> dict[str, int]:
    """The ports rank ``rank`` (>= 1) serves on: its block of ``base``, or free ones (base 0)."""
    if not base:
        return {"port": 0, "metrics_port": 0, "kv_port": 0, "prefill_metrics_port": 0}
    ports = ep_rank_ports(base, rank)
    return {
        "port": 0,  # a rank other than 0 serves no public port
        "metrics_port": ports.metrics,
        "kv_port": ports.kv,
        "prefill_metrics_port": ports.prefill_metrics,
    }


def internal_port(engine: EngineConfig) -> int:
    """The port of this rank's internal gRPC server (0: a free one)."""
    return ep_rank_ports(engine.ep_port_base, engine.ep_rank).grpc if engine.ep_port_base else 0


class GroupStartError(RuntimeError):
    """A rank exited or did not come up while the group was starting."""


def connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


class EpGroup:
    def __init__(
        self, engine: EngineConfig, store: dist.Store, followers: list[subprocess.Popen[bytes]]
    ) -> None:
        self.rank = engine.ep_rank
        self.size = engine.ep
        self.timeout = timedelta(seconds=engine.ep_timeout_s)
        self._store = store
        self.followers = followers

    @classmethod
    def lead(cls, command: str, config_cls: type, config: Any, host: str) -> EpGroup:
        """Rank 0: hosts the store and starts the other ranks of ``pdserve <command>``. Call it on
        the main thread: a follower gets SIGTERM when the thread that started it ends."""
        engine: EngineConfig = config.engine
        store_port = ep_rank_ports(engine.ep_port_base, 0).group_store if engine.ep_port_base else 0
        store = host_store(host, store_port, timedelta(seconds=STARTUP_TIMEOUT_S))
        master = f"{connect_host(host)}:{store.port}"
        followers = []
        for rank in range(1, engine.ep):
            overrides = rank_port_overrides(engine.ep_port_base, rank)
            args = flags.to_args(config_cls, config, ep_rank=rank, ep_master=master, **overrides)
            followers.append(
                subprocess.Popen(
                    with_parent_death_signal([sys.executable, "-m", "pdserve", command, *args], os.getpid()),
                    stdout=subprocess.DEVNULL,
                )
            )
        logger.info(
            "expert-parallel group of %d: store %s, ranks 1..%d started", engine.ep, master, engine.ep - 1
        )
        return cls(engine, store, followers)

    @classmethod
    def join(cls, engine: EngineConfig) -> EpGroup:
        store = connect_store(engine.ep_master, timedelta(seconds=STARTUP_TIMEOUT_S))
        return cls(engine, store, [])

    def publish(self, info: dict[str, Any]) -> None:
        self._store.set(f"rank/{self.rank}", json.dumps(info))

    def gather(self) -> list[dict[str, Any]]:
        """Rank 0: every rank's published info, once all are up; then lets them all go on."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank in range(1, self.size):
            while not self._store.check([f"rank/{rank}"]):
                self.check_followers()
                if time.monotonic() > deadline:
                    raise GroupStartError(f"rank {rank} did not come up in {STARTUP_TIMEOUT_S:.0f} s")
                time.sleep(POLL_S)
        infos = [json.loads(self._store.get(f"rank/{r}")) for r in range(self.size)]
        self._store.set("go", "1")
        return infos

    def wait_for_go(self) -> None:
        """Ranks other than 0: wait until every rank is up."""
        self._store.wait(["go"], timedelta(seconds=STARTUP_TIMEOUT_S))

    def mark_warm(self) -> None:
        """This rank has warmed up its compiled forwards (or had none to warm up)."""
        self._store.set(f"warm/{self.rank}", "1")

    def all_warm(self) -> bool:
        """Rank 0: whether every rank has marked itself warm."""
        return bool(self._store.check([f"warm/{r}" for r in range(self.size)]))

    def form(self, device: torch.device) -> None:
        """Forms the process group (every rank at once, after ``gather``/``wait_for_go``)."""
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg/", self._store),
            rank=self.rank,
            world_size=self.size,
            timeout=self.timeout,
            device_id=device if device.type == "cuda" else None,
        )

    def check_followers(self) -> None:
        for rank, process in enumerate(self.followers, start=1):
            if process.poll() is not None:
                raise GroupStartError(f"expert-parallel rank {rank} exited with {process.returncode}")

    def close(self, timeout_s: float = 10.0) -> None:
        """Leaves the process group; rank 0 waits for its followers, then kills what is left."""
        if dist.is_initialized():
            dist.destroy_process_group()
        deadline = time.monotonic() + timeout_s
        for process in self.followers:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
