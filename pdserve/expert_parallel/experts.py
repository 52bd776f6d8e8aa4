"""Expert parallelism through transformers' experts interface, without forking the model.

``shard_experts`` keeps, in every MoE layer's experts module, only the experts this rank owns, and
attaches the rank's dispatch; the implementation registered here under ``EP_IMPLEMENTATION`` then
replaces the experts' forward: ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``
hands the tokens to the dispatch, which runs them on their owners' experts and brings them back.
Any model whose experts use the fused layout (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``,
no bias) behind ``@use_experts_implementation`` works: DeepSeekMoE, DeepseekV2/V3, Qwen2Moe, Mixtral.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from pdserve.expert_parallel.dispatch import Dispatch

EP_IMPLEMENTATION = "pdserve_expert_parallel"


class ShardedExperts:
    """One MoE layer's local experts, run one at a time by the dispatch."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def run_expert(self, local_expert: int, hidden_states: torch.Tensor) -> torch.Tensor:
        m: Any = self._module
        gate_up = F.linear(hidden_states, m.gate_up_proj[local_expert])
        return F.linear(m._apply_gate(gate_up), m.down_proj[local_expert])

    def run_all(self, hidden_states: torch.Tensor) -> torch.Tensor:
        m: Any = self._module
        gate_up = torch.bmm(hidden_states, m.gate_up_proj.transpose(1, 2))
        return torch.bmm(m._apply_gate(gate_up), m.down_proj.transpose(1, 2))


def expert_parallel_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    module: Any = self
    dispatch: Dispatch = module.pdserve_dispatch
    result: torch.Tensor = dispatch(module.pdserve_local_experts, hidden_states, top_k_index, top_k_weights)
    return result


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The fused experts modules of a model, in layer order."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and hasattr(m, "_is_expert_parallel")
    ]


def num_routed_experts(model: nn.Module) -> int:
    modules = experts_modules(model)
    if not modules:
        raise ValueError(
            f"expert parallelism needs a mixture-of-experts model; {type(model).__name__} has no routed experts"
        )
    first: Any = modules[0]
    return int(first.gate_up_proj.shape[0])


def shard_experts(
    model: nn.Module, rank: int, size: int, make_dispatch: Callable[[int], Dispatch]
) -> Dispatch:
    """Keeps rank ``rank``'s experts in every MoE layer and routes them through one dispatch."""
    modules = experts_modules(model)
    num_experts = num_routed_experts(model)
    if num_experts % size:
        raise ValueError(
            f"{num_experts} routed experts do not split evenly over {size} expert-parallel ranks"
        )
    for m in modules:
        layout: Any = m
        if layout.has_bias or layout.is_transposed or not layout.is_concatenated or not layout.has_gate:
            raise ValueError(f"{type(m).__name__}: only fused, gated experts without bias can be sharded")
        if int(layout.gate_up_proj.shape[0]) != num_experts:
            raise ValueError("every MoE layer must have the same number of routed experts")
    dispatch = make_dispatch(num_experts)
    local = num_experts // size
    owned = slice(rank * local, (rank + 1) * local)
    for m in modules:
        layout = m
        layout.gate_up_proj = nn.Parameter(layout.gate_up_proj.data[owned].clone(), requires_grad=False)
        layout.down_proj = nn.Parameter(layout.down_proj.data[owned].clone(), requires_grad=False)
        layout.pdserve_dispatch = dispatch
        layout.pdserve_local_experts = ShardedExperts(m)
        layout._is_expert_parallel = True
    ALL_EXPERTS_FUNCTIONS.register(EP_IMPLEMENTATION, expert_parallel_forward)
    model_any: Any = model
    model_any.set_experts_implementation(EP_IMPLEMENTATION)
    return dispatch
