"""The all-to-all dispatch/combine of expert parallelism, on 2 real gloo ranks (2 processes), against
the single-process eager experts of the same layer run on the whole group's tokens: the same output
bit for bit,
including ranks that send or receive no token, experts that get none, masked routes and a token
that picks one expert twice. The expert-order sum alone, against the eager experts, in float32 and
bfloat16. Then the whole expert-parallel model path (sharding on the CPU through transformers'
experts interface, dispatch, lockstep) on every MoE preset in a group of one rank."""

from __future__ import annotations

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
from pdserve.expert_parallel.expert_order import expert_keys, sum_in_expert_order
from pdserve.expert_parallel.experts import ShardedExperts, shard_experts
from pdserve.expert_parallel.rank_model import ExpertSharding, expert_parallel_model
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
    "masked routes": [[[0, EXPERTS], [EXPERTS, 7]], [[EXPERTS, EXPERTS], [-1, 3]]],
    "duplicate experts": [[[2, 2], [5, 1], [6, 6]], [[1, 1], [3, 2]]],
    "one expert only": [[[4, 4], [4, EXPERTS]], [[4, -1]]],
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
    index = torch.where(index < 0, EXPERTS, index)  # the eager experts skip ids >= E only
    weights = torch.rand((len(ids), TOP_K), generator=generator)
    return hidden, index, weights


def _whole_group(module: DeepseekMoeExperts, per_rank: list[list[list[int]]]) -> list[torch.Tensor]:
    """The eager experts on every rank's tokens at once, split back by rank: each expert then runs
    over the same rows, in the same order, as on its owner rank."""
    inputs = [_inputs(r, ids) for r, ids in enumerate(per_rank)]
    out = module(*(torch.cat(parts) for parts in zip(*inputs, strict=True)))
    return list(out.split([len(ids) for ids in per_rank]))


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
                want = _whole_group(module, per_rank)[rank]
            again = dispatch(local, hidden, index, weights)
            results.put(
                (
                    name,
                    rank,
                    torch.equal(got, want) and torch.equal(again, got),
                    float((got - want).abs().max()) if len(got) else 0.0,
                )
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
    for (name, rank), (equal, diff) in outcomes.items():
        assert equal, f"{name}, rank {rank}: not bit-identical (max difference {diff})"
    stats = {
        rank: (idle_ranks, idle_experts) for name, rank, idle_ranks, idle_experts in got if name == "stats"
    }
    assert stats[1][0] >= 1, "rank 1 never received zero tokens, though a case routes nothing to it"
    assert all(idle_experts > 0 for _, idle_experts in stats.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_expert_order_sum_makes_the_eager_experts_additions(seed: int, dtype: torch.dtype) -> None:
    """Contributions computed in any order, added by ``sum_in_expert_order``: the eager experts' output."""
    generator = torch.Generator().manual_seed(seed)
    module = _experts().to(dtype)
    num_tokens, top_k = 7, 3
    if dtype == torch.float32:  # masked routes, and an expert picked twice by one token
        ids = torch.randint(-1, EXPERTS + 2, (num_tokens, top_k), generator=generator)
    else:  # distinct per token, as a router picks them: CPU index_add_ adds a call's bfloat16 duplicates in float32
        ids = torch.stack(
            [torch.randperm(EXPERTS + 3, generator=generator)[:top_k] - 1 for _ in range(num_tokens)]
        )
    hidden = torch.randn((num_tokens, HIDDEN), generator=generator).to(dtype)
    weights = torch.rand((num_tokens, top_k), generator=generator).to(dtype)
    keys = expert_keys(ids, EXPERTS)
    routes = (keys < EXPERTS).reshape(-1).nonzero().flatten()
    routes = routes[torch.randperm(len(routes), generator=generator)]  # any order of computation
    flat = keys.reshape(-1)
    local = ShardedExperts(module)
    rows = []
    with torch.no_grad():
        for expert in range(EXPERTS):  # each expert over its rows in token order, as the eager experts do
            taken = (flat == expert).nonzero().flatten()
            if len(taken):
                out = local.run_expert(expert, hidden[taken // top_k]) * weights.reshape(-1)[taken, None]
                rows += list(zip(taken.tolist(), out, strict=True))
        want = module(hidden, torch.where(ids < 0, EXPERTS, ids), weights)
    shuffled = [rows[i] for i in torch.randperm(len(rows), generator=generator).tolist()]  # any order
    routes = torch.tensor([r for r, _ in shuffled], dtype=torch.long)
    values = torch.stack([v for _, v in shuffled]) if shuffled else hidden.new_zeros((0, HIDDEN))
    assert torch.equal(sum_in_expert_order(values, routes, keys), want)


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
    reference = load_engine_model(EngineConfig(model=model_name, cache_dir=str(cache_dir))).model
    reference.set_experts_implementation("eager")  # adds in expert order (transformers' default: by slot)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
    sharding = ExpertSharding(0, 1)
    m = load_engine_model(EngineConfig(model=model_name, cache_dir=str(cache_dir)), sharding)
    rank_model = expert_parallel_model(m, sharding)
    rank_model.lockstep.start()
    try:
        got = rank_model.engine_model.forward(input_ids=ids).logits
    finally:
        rank_model.lockstep.stop()
        rank_model.lockstep.join(30)
    assert torch.equal(got, want), "a group of one adds the experts exactly as the eager experts do"
    assert rank_model.dispatch.stats.calls > 0, "the forward did not go through the dispatch"
    assert rank_model.dispatch.tick_tokens == ids.numel(), "the lockstep tells the dispatch its tick's tokens"
    assert rank_model.lockstep.failure is None
    assert (
        m.fingerprint
        == load_engine_model(EngineConfig(model=model_name, cache_dir=str(cache_dir))).fingerprint
    )


def test_a_rank_keeps_only_its_experts_before_its_model_moves(cache_dir: Path) -> None:
    sharding = ExpertSharding(1, 2)
    m = load_engine_model(EngineConfig(model="tiny-deepseek-moe", cache_dir=str(cache_dir)), sharding)
    experts = m.model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape[0] == 4 and sharding.shard == ExpertShard(1, 2, 8)
    full = load_engine_model(EngineConfig(model="tiny-deepseek-moe", cache_dir=str(cache_dir)))
    assert torch.equal(experts.gate_up_proj, full.model.model.layers[1].mlp.experts.gate_up_proj[4:])
    assert m.kv_layout == full.kv_layout and m.fingerprint == full.fingerprint


def test_a_dense_model_cannot_be_sharded(cache_dir: Path) -> None:
    m = load_engine_model(EngineConfig(model="tiny-llama", cache_dir=str(cache_dir)))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        shard_experts(m.model, 0, 2, lambda n: AllToAllDispatch(ExpertShard(0, 2, n)))
