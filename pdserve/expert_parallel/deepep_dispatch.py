"""Dispatch/combine with DeepEP's normal (intranode NVLink) kernels, for bfloat16 on CUDA.

Calls ``deep_ep.Buffer`` as pinned in the Dockerfile (``DEEPEP_REF``, ``deep_ep/buffer.py``):
1. ``get_dispatch_layout(topk_idx [T, k], E)``: tokens per rank and per expert, which token goes to
   which rank. ``topk_idx`` has DeepEP's index dtype (``deep_ep.topk_idx_t``), -1 for masked routes;
2. ``dispatch(x, ..., num_worst_tokens=W)``: each token travels once to every rank owning one of its
   experts. This rank gets ``recv_x [W, H]``, ``recv_topk_idx [W, k]`` (local expert ids, -1 for
   experts elsewhere and for the padding rows after the received ones) and ``recv_topk_weights
   [W, k]`` (float32). ``W`` is the group's most tokens at this tick times the group size, so the
   CPU never spins waiting for the received count (DeepEP holds the GIL while it does); when the
   tick's tokens are unknown, ``W`` is 0 and DeepEP waits for the exact count;
3. each local expert runs once over its rows; the weighted outputs are added per token in expert
   order (``expert_order``: a fixed order, no atomics), one host sync per layer for the counts;
4. ``combine(out [W, H], handle)`` adds every rank's part back on the token's own rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pdserve.expert_parallel.dispatch import DispatchStats, ExpertShard, LocalExperts
from pdserve.expert_parallel.expert_order import expert_keys, sum_in_expert_order


def deepep_topk_idx(top_k_index: torch.Tensor, num_experts: int, index_dtype: torch.dtype) -> torch.Tensor:
    """DeepEP's ``topk_idx``: ids in ``[0, num_experts)`` as they are, every other id -1."""
    keys = expert_keys(top_k_index, num_experts)
    return torch.where(keys < num_experts, keys, -1).to(index_dtype).contiguous()


class DeepEpDispatch:
    def __init__(
        self,
        shard: ExpertShard,
        buffer: Any,
        index_dtype: torch.dtype,
        worst_tokens: Callable[[], int] = lambda: 0,
        stats: DispatchStats | None = None,
    ) -> None:
        self.size = shard.size
        self.num_experts = shard.num_experts
        self.num_local = shard.num_local
        self._buffer = buffer
        self._index_dtype = index_dtype
        self._worst_tokens = worst_tokens
        self.stats = stats or DispatchStats()

    def __call__(
        self,
        experts: LocalExperts,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        topk_idx = deepep_topk_idx(top_k_index, self.num_experts, self._index_dtype)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self._buffer.get_dispatch_layout(
            topk_idx, self.num_experts
        )
        recv_x, recv_idx, recv_weights, _, handle, _ = self._buffer.dispatch(
            hidden_states.contiguous(),
            topk_idx=topk_idx,
            topk_weights=top_k_weights.to(torch.float32).contiguous(),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            num_worst_tokens=self._worst_tokens(),
        )
        out = self.run_local(experts, recv_x, recv_idx, recv_weights)
        combined, _, _ = self._buffer.combine(out, handle)
        result: torch.Tensor = combined
        return result

    def run_local(
        self,
        experts: LocalExperts,
        recv_x: torch.Tensor,
        recv_idx: torch.Tensor,
        recv_weights: torch.Tensor,
    ) -> torch.Tensor:
        """``[W, H]``: per received row, its local experts' weighted outputs added in expert order."""
        keys = expert_keys(recv_idx, self.num_local)
        routed = keys < self.num_local
        counts = torch.bincount(keys.reshape(-1), minlength=self.num_local + 1)[: self.num_local]
        *per_expert, num_rows = torch.cat([counts, routed.any(dim=1).sum().view(1)]).tolist()
        self.stats.count(per_expert)
        out = torch.zeros_like(recv_x)
        if num_rows == 0:
            return out
        keys = keys[:num_rows]  # the received rows come first, padding rows (all -1) after
        order = torch.argsort(keys.reshape(-1), stable=True)[: sum(per_expert)]
        rows = order // keys.shape[1]
        weights = recv_weights.reshape(-1)[order].to(recv_x.dtype)
        values = recv_x.new_empty((len(order), recv_x.shape[1]))
        start = 0
        for expert, count in enumerate(per_expert):
            if count:
                taken = slice(start, start + count)
                values[taken] = experts.run_expert(expert, recv_x[rows[taken]]) * weights[taken, None]
                start += count
        out[:num_rows] = sum_in_expert_order(values, order, keys)
        return out
