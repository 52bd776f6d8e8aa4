"""Dispatch/combine with DeepEP's normal (intranode NVLink) kernels, on CUDA when ``deep_ep`` is installed.

DeepEP sends each token once to every rank that owns one of its experts; the owner gets the token
with its top-k ids translated to local expert ids (-1 for experts elsewhere) and the routing
weights, runs each local expert over its tokens, adds the weighted outputs per token, and the
combine sums every rank's part back on the token's own rank. The buffer is sized by DeepEP's own
hints and made on the first call (the process group exists by then). Hidden states that are not
bfloat16 (DeepEP's normal kernels move bf16) take the all_to_all_single path instead.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pdserve.expert_parallel.all_to_all_dispatch import AllToAllDispatch
from pdserve.expert_parallel.dispatch import DispatchStats, ExpertShard, LocalExperts


class DeepEpDispatch:
    def __init__(self, shard: ExpertShard) -> None:
        self.size = shard.size
        self.num_experts = shard.num_experts
        self.num_local = shard.num_local
        self._buffer: Any = None
        self._fallback = AllToAllDispatch(shard)
        self.stats = self._fallback.stats  # one set of counts for both paths

    def __call__(
        self,
        experts: LocalExperts,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        if hidden_states.dtype != torch.bfloat16 or hidden_states.device.type != "cuda":
            return self._fallback(experts, hidden_states, top_k_index, top_k_weights)
        buffer = self._buffer_for(hidden_states)
        topk_idx = torch.where(top_k_index < self.num_experts, top_k_index, -1).to(torch.int64)
        weights = top_k_weights.to(torch.float32)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            topk_idx, self.num_experts
        )
        recv_x, recv_idx, recv_weights, recv_per_expert, handle, _ = buffer.dispatch(
            hidden_states,
            topk_idx=topk_idx,
            topk_weights=weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        out = self._run_local(experts, recv_x, recv_idx, recv_weights, list(recv_per_expert))
        combined, _, _ = buffer.combine(out, handle)
        result: torch.Tensor = combined
        return result

    def _run_local(
        self,
        experts: LocalExperts,
        recv_x: torch.Tensor,
        recv_idx: torch.Tensor,
        recv_weights: torch.Tensor,
        recv_per_expert: list[int],
    ) -> torch.Tensor:
        stats: DispatchStats = self.stats
        stats.calls += 1
        out = torch.zeros_like(recv_x)
        if recv_x.shape[0] == 0:
            stats.idle_ranks += 1
            stats.idle_experts += self.num_local
            return out
        for expert, count in enumerate(recv_per_expert):
            if count == 0:
                stats.idle_experts += 1
                continue
            rows, slots = (recv_idx == expert).nonzero(as_tuple=True)
            routed = experts.run_expert(expert, recv_x[rows]) * recv_weights[rows, slots, None]
            out.index_add_(0, rows, routed.to(out.dtype))
        return out

    def _buffer_for(self, hidden_states: torch.Tensor) -> Any:
        if self._buffer is None:
            from deep_ep import Buffer

            hidden_bytes = hidden_states.shape[-1] * max(hidden_states.element_size(), 2)
            num_nvl_bytes = max(
                config.get_nvl_buffer_size_hint(hidden_bytes, self.size)
                for config in (Buffer.get_dispatch_config(self.size), Buffer.get_combine_config(self.size))
            )
            self._buffer = Buffer(dist.group.WORLD, num_nvl_bytes, 0)
        return self._buffer
