"""One rank's model: its own experts only, each forward run at the group's next tick.

``ExpertSharding`` is handed to ``load_engine_model`` and keeps this rank's experts while the model
is still on the CPU, so a GPU never holds the experts of other ranks; ``expert_parallel_model``
then puts the loaded model's forwards in lockstep with the other ranks.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.expert_parallel.all_to_all_dispatch import AllToAllDispatch
from pdserve.expert_parallel.dispatch import ExpertShard
from pdserve.expert_parallel.dispatch_choice import UNKNOWN_TOKENS, DispatchChoice
from pdserve.expert_parallel.experts import shard_experts
from pdserve.expert_parallel.lockstep import Lockstep
from pdserve.model.engine_model import EngineModel


def forward_tokens(inputs: dict[str, Any]) -> int:
    """How many tokens a forward on ``inputs`` runs (``UNKNOWN_TOKENS`` when it cannot tell)."""
    ids = inputs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    embeds = inputs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor):
        return embeds.shape[:-1].numel()
    return UNKNOWN_TOKENS


@dataclass(frozen=True)
class LockstepEngineModel(EngineModel):
    """An engine model whose forwards run at the group's ticks, each with its number of tokens."""

    lockstep: Lockstep | None = None

    def forward(self, **inputs: Any) -> Any:
        if self.lockstep is None:
            return super().forward(**inputs)
        module = self.model if self.forward_module is None else self.forward_module
        return self.lockstep.run(lambda: module(**inputs), forward_tokens(inputs))


class ExpertSharding:
    """Keeps rank ``rank``'s experts of a model (called on the CPU copy, before it moves to its device)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.dispatch: DispatchChoice | None = None
        self.shard: ExpertShard | None = None

    def __call__(self, model: Any) -> None:
        def make(num_experts: int) -> DispatchChoice:
            self.shard = ExpertShard(self.rank, self.size, num_experts)
            return DispatchChoice(AllToAllDispatch(self.shard))

        dispatch = shard_experts(model, self.rank, self.size, make)
        if not isinstance(dispatch, DispatchChoice):
            raise TypeError("shard_experts did not return the dispatch it was given")
        self.dispatch = dispatch


@dataclass(frozen=True)
class RankModel:
    engine_model: LockstepEngineModel  # forwards go through the lockstep
    lockstep: Lockstep
    dispatch: DispatchChoice
    shard: ExpertShard


def expert_parallel_model(engine_model: EngineModel, sharding: ExpertSharding) -> RankModel:
    """Puts the forwards of ``engine_model`` (loaded with ``sharding``) in lockstep with the other
    ranks; the lockstep is started once the group has formed."""
    if sharding.dispatch is None or sharding.shard is None:
        raise ValueError("the model was not loaded with this rank's expert sharding")
    model = engine_model.model
    device = engine_model.device
    dispatch = sharding.dispatch

    def filler() -> None:
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)

    lockstep = Lockstep(filler, device, leader=sharding.rank == 0, on_tick=dispatch.set_tick_tokens)
    fields = {f.name: getattr(engine_model, f.name) for f in dataclasses.fields(EngineModel)}
    stepped = LockstepEngineModel(**{**fields, "run_forward": lockstep.run}, lockstep=lockstep)
    return RankModel(stepped, lockstep, dispatch, sharding.shard)
