"""One rank's model: its own experts only, each forward run at the group's next tick."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.expert_parallel.all_to_all_dispatch import AllToAllDispatch
from pdserve.expert_parallel.dispatch import Dispatch, ExpertShard
from pdserve.expert_parallel.experts import shard_experts
from pdserve.expert_parallel.lockstep import Lockstep
from pdserve.model.engine_model import EngineModel


@dataclass(frozen=True)
class RankModel:
    engine_model: EngineModel  # forwards go through the lockstep
    lockstep: Lockstep
    dispatch: Dispatch


def deepep_available(device: torch.device) -> bool:
    return device.type == "cuda" and importlib.util.find_spec("deep_ep") is not None


def dispatch_factory(rank: int, size: int, device: torch.device) -> Callable[[int], Dispatch]:
    """DeepEP's kernels on CUDA when ``deep_ep`` is installed, all_to_all_single otherwise."""
    if deepep_available(device):
        from pdserve.expert_parallel.deepep_dispatch import DeepEpDispatch

        return lambda num_experts: DeepEpDispatch(ExpertShard(rank, size, num_experts))
    return lambda num_experts: AllToAllDispatch(ExpertShard(rank, size, num_experts))


def expert_parallel_model(engine_model: EngineModel, rank: int, size: int) -> RankModel:
    """Shards the experts of ``engine_model`` in place for ``rank`` of ``size`` and puts its forwards
    in lockstep with the other ranks (the lockstep is started once the group has formed)."""
    model = engine_model.model
    device = engine_model.device
    dispatch = shard_experts(model, rank, size, dispatch_factory(rank, size, device))

    def filler() -> None:
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)

    lockstep = Lockstep(filler, device, leader=rank == 0)
    return RankModel(dataclasses.replace(engine_model, run_forward=lockstep.run), lockstep, dispatch)
