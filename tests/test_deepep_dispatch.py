"""The arithmetic of the DeepEP dispatches on CPU, with stand-in buffers (``tests/deepep_stand_in``)
that return what DeepEP's kernels would hand each rank of a 2-rank group.

Normal kernels: each rank's part, before the combine, equals bit for bit the single-process eager
experts run on the rows it received with only its own experts (masked routes, duplicate experts,
a rank that receives nothing, idle experts, padding rows of ``num_worst_tokens``), and the parts
added back per token give the eager experts' output. Low-latency kernels: each expert runs on its
received rows only, and the weighted combine gives the eager experts' output.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.expert_parallel.deepep_dispatch import DeepEpDispatch
from pdserve.expert_parallel.deepep_low_latency_dispatch import DeepEpLowLatencyDispatch
from pdserve.expert_parallel.dispatch import ExpertShard
from pdserve.expert_parallel.experts import ShardedExperts
from pdserve.model.deepseek_moe import DeepseekMoeConfig
from pdserve.model.deepseek_moe.modeling import DeepseekMoeExperts
from tests import deepep_stand_in as stand_in

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, SIZE = 16, 8, 8, 3, 2
LOCAL = EXPERTS // SIZE
M = EXPERTS  # a masked route (id >= E), as a router may emit; -1 is masked too

# Per case: each rank's top-k expert ids ([T, k]).
CASES: dict[str, list[list[list[int]]]] = {
    "mixed": [[[0, 5, 2], [7, 2, 4], [3, 4, 6]], [[1, 6, 7], [6, 0, 3]]],
    "all to rank 0": [[[0, 1, 2], [2, 3, 0]], [[3, 0, 1], [1, 2, 3], [0, 2, 1]]],  # rank 1 receives nothing
    "masked routes": [[[0, M, -1], [M, 7, 5]], [[M, M, -1], [4, -1, 1]]],  # a token with no route
    "duplicate experts": [[[2, 2, 6], [5, 5, 5]], [[1, 7, 1]]],
    "one expert only": [[[4, M, M]], [[4, -1, -1], [4, M, -1]]],  # idle experts on both ranks
}


def _module() -> DeepseekMoeExperts:
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


class _Owned(torch.nn.Module):
    """Rank ``rank``'s slice of the experts, as a sharded module holds it."""

    def __init__(self, module: DeepseekMoeExperts, rank: int) -> None:
        super().__init__()
        self.gate_up_proj = module.gate_up_proj.data[rank * LOCAL : (rank + 1) * LOCAL]
        self.down_proj = module.down_proj.data[rank * LOCAL : (rank + 1) * LOCAL]
        self.act_fn = module.act_fn

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        out: torch.Tensor = self.act_fn(gate) * up
        return out


def _inputs(case: str) -> list[stand_in.Routed]:
    inputs = []
    for rank, ids in enumerate(CASES[case]):
        generator = torch.Generator().manual_seed(100 + rank)
        index = torch.tensor(ids, dtype=torch.long).reshape(len(ids), TOP_K)
        inputs.append(
            stand_in.Routed(
                torch.randn((len(ids), HIDDEN), generator=generator),
                index,
                torch.rand((len(ids), TOP_K), generator=generator),
            )
        )
    return inputs


def _eager(
    module: DeepseekMoeExperts, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = module(hidden, torch.where(ids < 0, EXPERTS, ids), weights)
    return out


@pytest.mark.parametrize("worst", [0, 12], ids=["counted", "num_worst_tokens"])
@pytest.mark.parametrize("case", list(CASES))
def test_normal_kernels_part_per_rank_is_the_eager_experts_bit_for_bit(case: str, worst: int) -> None:
    module = _module()
    inputs = _inputs(case)
    received = stand_in.simulate(inputs, EXPERTS, worst)
    partials, results = [], []
    for rank in range(SIZE):
        buffer = stand_in.NormalBuffer(received[rank], SIZE, EXPERTS)
        dispatch = DeepEpDispatch(
            ExpertShard(rank, SIZE, EXPERTS), buffer, stand_in.INDEX_DTYPE, worst_tokens=lambda: worst
        )
        routed = inputs[rank]
        with torch.no_grad():
            dispatch(ShardedExperts(_Owned(module, rank)), routed.hidden, routed.ids, routed.weights)
        names = [name for name, _ in buffer.calls]
        assert names == ["get_dispatch_layout", "dispatch", "combine"], "every rank takes part in every call"
        sent = buffer.calls[1][1]
        assert sent["topk_idx"].dtype == stand_in.INDEX_DTYPE and sent["topk_weights"].dtype == torch.float32
        assert torch.equal(sent["topk_idx"], torch.where(routed.ids < EXPERTS, routed.ids, -1))
        assert sent["num_worst_tokens"] == worst
        part = buffer.combined_input
        assert part is not None and part.shape == received[rank].recv_x.shape
        rows = len(received[rank].sources)
        rec = received[rank]
        global_ids = torch.where(rec.recv_idx[:rows] >= 0, rec.recv_idx[:rows] + rank * LOCAL, -1)
        want = _eager(module, rec.recv_x[:rows], global_ids, rec.recv_weights[:rows])
        assert torch.equal(part[:rows], want), f"{case}, rank {rank}"
        assert not part[rows:].any(), "padding rows add nothing"
        partials.append(part)
        results.append(dispatch.stats)
    for got, routed in zip(stand_in.combine_normal(received, partials, inputs), inputs, strict=True):
        torch.testing.assert_close(got, _eager(module, routed.hidden, routed.ids, routed.weights))
    if case == "all to rank 0":
        assert results[1].idle_ranks == 1 and results[1].idle_experts == LOCAL
    if case == "one expert only":
        assert results[0].idle_experts == LOCAL and results[1].idle_experts == LOCAL - 1


@pytest.mark.parametrize("case", list(CASES))
def test_low_latency_kernels_run_each_expert_on_its_rows_only(case: str) -> None:
    module = _module()
    inputs = _inputs(case)
    max_tokens = 4
    received = stand_in.simulate_low_latency(inputs, EXPERTS, max_tokens)
    outputs = []
    for rank in range(SIZE):
        buffer = stand_in.LowLatencyBuffer(received[rank])
        dispatch = DeepEpLowLatencyDispatch(
            ExpertShard(rank, SIZE, EXPERTS), buffer, stand_in.INDEX_DTYPE, max_tokens
        )
        routed = inputs[rank]
        with torch.no_grad():
            dispatch(ShardedExperts(_Owned(module, rank)), routed.hidden, routed.ids, routed.weights)
        assert [name for name, _ in buffer.calls] == ["low_latency_dispatch", "low_latency_combine"]
        sent = buffer.calls[0][1]
        assert sent["topk_idx"].dtype == stand_in.INDEX_DTYPE and sent["use_fp8"] is False
        assert sent["max_tokens"] == max_tokens
        assert buffer.calls[1][1]["topk_weights"].dtype == torch.float32
        out = buffer.combined_input
        assert out is not None and out.shape == received[rank].recv_x.shape
        counts = received[rank].recv_count.tolist()
        for e, count in enumerate(counts):
            rows = received[rank].recv_x[e, :count]
            with torch.no_grad():
                want = ShardedExperts(_Owned(module, rank)).run_expert(e, rows)
            torch.testing.assert_close(out[e, :count], want, rtol=1e-6, atol=1e-6)
        assert not out[:, max(counts, default=0) :].any(), "rows past every count stay zero"
        outputs.append(out)
    for got, routed in zip(stand_in.combine_low_latency(received, outputs, inputs), inputs, strict=True):
        torch.testing.assert_close(got, _eager(module, routed.hidden, routed.ids, routed.weights))


def test_low_latency_refuses_more_tokens_than_its_buffer() -> None:
    inputs = _inputs("mixed")
    received = stand_in.simulate_low_latency(inputs, EXPERTS, 4)
    dispatch = DeepEpLowLatencyDispatch(
        ExpertShard(0, SIZE, EXPERTS), stand_in.LowLatencyBuffer(received[0]), stand_in.INDEX_DTYPE, 2
    )
    with pytest.raises(ValueError, match="exceed the low-latency buffer"):
        dispatch(ShardedExperts(_Owned(_module(), 0)), inputs[0].hidden, inputs[0].ids, inputs[0].weights)
    with pytest.raises(ValueError, match="max_tokens"):
        DeepEpLowLatencyDispatch(ExpertShard(0, SIZE, EXPERTS), None, stand_in.INDEX_DTYPE, 0)
