"""The all-to-all dispatch/combine of expert parallelism, on 2 real gloo ranks (2 processes), against
the single-process eager experts of the same layer: same output for the same tokens, including
ranks that send or receive no token and experts that get none. Then the whole expert-parallel
model path (sharding through transformers' experts interface, dispatch, lockstep) on every MoE
preset in a group of one rank."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.config import EngineConfig
from pdserve.expert_parallel.all_to_all_dispatch import AllToAllDispatch
from pdserve.expert_parallel.dispatch import ExpertShard
from pdserve.expert_parallel.experts import ShardedExperts, shard_experts
from pdserve.expert_parallel.rank_model import expert_parallel_model
from pdserve.model.deepseek_moe import DeepseekMoeConfig
from pdserve.model.deepseek_moe.modeling import DeepseekMoeExperts
from pdserve.model.engine_model import load_engine_model
from tests.stack import free_port

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, SIZE = 16, 8, 8, 2, 2

# Per case: each rank's top-k expert ids ([T, k]); T may be 0 and ids >= EXPERTS are masked routes.
CASES: dict[str, list[list[list[int]]]] = {
    "mixed": [[[0, 5], [7, 2], [3, 4]], [[1, 6], [6, 0]]],
    "all to rank 0": [[[0, 1], [2, 3]], [[3, 0], [1, 2], [0, 2]]],  # rank 1 receives nothing
    "rank 1 sends nothing": [[[4, 0], [5, 6]], []],
    "masked routes": [[[0, EXPERTS], [EXPERTS, 7]], [[EXPERTS, EXPERTS]]],
}


def _experts() -> DeepseekMoeExperts:
    config = DeepseekMoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, n_routed_experts=EXPERTS, hidden_act="silu"
    )
    config._experts_implementation = "eager"
    module = DeepseekMoeExperts(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=generator) * 0.2)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=generator) * 0.2)
    return module


def _inputs(rank: int, ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn((len(ids), HIDDEN), generator=generator)
    index = torch.tensor(ids, dtype=torch.long).reshape(len(ids), TOP_K)
    weights = torch.rand((len(ids), TOP_K), generator=generator)
    return hidden, index, weights


class _Owned:
    """Rank ``rank``'s slice of the experts, as a sharded module holds it."""

    def __init__(self, module: DeepseekMoeExperts, rank: int) -> None:
        local = EXPERTS // SIZE
        self.gate_up_proj = module.gate_up_proj.data[rank * local : (rank + 1) * local]
        self.down_proj = module.down_proj.data[rank * local : (rank + 1) * local]
        self.act_fn = module.act_fn

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        out: torch.Tensor = self.act_fn(gate) * up
        return out


def _rank(rank: int, port: int, results: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, SIZE, rank == 0, timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=SIZE, timeout=timedelta(seconds=30))
    try:
        module = _experts()
        dispatch = AllToAllDispatch(ExpertShard(rank, SIZE, EXPERTS))
        local = ShardedExperts(_Owned(module, rank))  # type: ignore[arg-type]
        for name, per_rank in CASES.items():
            hidden, index, weights = _inputs(rank, per_rank[rank])
            with torch.no_grad():
                got = dispatch(local, hidden, index, weights)
                want = module(hidden, index, weights)
            results.put(
                (name, rank, torch.equal(got, want), float((got - want).abs().max()) if len(got) else 0.0)
            )
        results.put(("stats", rank, dispatch.stats.idle_ranks, dispatch.stats.idle_experts))
    finally:
        dist.destroy_process_group()


def test_all_to_all_dispatch_equals_single_process_experts() -> None:
    port = free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(SIZE)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(120)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    got = [results.get(timeout=5) for _ in range(SIZE * (len(CASES) + 1))]
    outcomes = {(name, rank): (equal, diff) for name, rank, equal, diff in got if name != "stats"}
    assert len(outcomes) == SIZE * len(CASES)
    for (name, rank), (_, diff) in outcomes.items():
        assert diff < 1e-6, f"{name}, rank {rank}: max difference {diff}"
    stats = {
        rank: (idle_ranks, idle_experts) for name, rank, idle_ranks, idle_experts in got if name == "stats"
    }
    assert stats[1][0] >= 1, "rank 1 never received zero tokens, though a case routes nothing to it"
    assert all(idle_experts > 0 for _, idle_experts in stats.values())


@pytest.mark.parametrize(
    ("rank", "size", "message"),
    [(0, 3, "split evenly"), (2, 2, "rank must be in"), (-1, 2, "rank must be in")],
)
def test_bad_expert_shards_are_refused(rank: int, size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExpertShard(rank, size, EXPERTS)


@pytest.fixture
def group_of_one() -> Iterator[None]:
    """This process as a 1-rank gloo group: the whole expert-parallel path, no peer needed."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model_name", ["tiny-moe", "tiny-mla-moe", "tiny-deepseek-moe"])
def test_every_moe_preset_runs_through_the_experts_interface(
    model_name: str, cache_dir: Path, group_of_one: None
) -> None:
    m = load_engine_model(EngineConfig(model=model_name, cache_dir=str(cache_dir)))
    reference = copy.deepcopy(m.model)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    rank_model = expert_parallel_model(m, 0, 1)
    rank_model.lockstep.start()
    try:
        got = rank_model.engine_model.forward(input_ids=ids).logits
    finally:
        rank_model.lockstep.stop()
        rank_model.lockstep.join(30)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rank_model.dispatch.stats.calls > 0, "the forward did not go through the dispatch"
    assert rank_model.lockstep.failure is None


def test_a_dense_model_cannot_be_sharded(cache_dir: Path) -> None:
    m = load_engine_model(EngineConfig(model="tiny-llama", cache_dir=str(cache_dir)))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        shard_experts(m.model, 0, 2, lambda n: AllToAllDispatch(ExpertShard(0, 2, n)))
