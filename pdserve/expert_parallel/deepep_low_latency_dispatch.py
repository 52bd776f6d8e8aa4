"""Dispatch/combine with DeepEP's low-latency kernels, for decode steps (bfloat16 on CUDA).

Calls ``deep_ep.Buffer`` (made with ``low_latency_mode=True``) as pinned in the Dockerfile
(``DEEPEP_REF``, ``deep_ep/buffer.py``):
1. ``low_latency_dispatch(x [T, H], topk_idx [T, k], max_tokens, E, use_fp8=False)`` with ``T <=
   max_tokens`` (every rank passes the same ``max_tokens``, the size the buffer was made for):
   ``recv_x [E_local, size * max_tokens, H]`` (bfloat16) holds, for local expert ``e``, its
   ``recv_count[e]`` received rows first (``recv_count [E_local]``, int32, on the device); no
   CPU wait inside DeepEP, and no layout step;
2. every local expert runs on the first ``max(recv_count)`` rows of its slot in one batched matmul
   (one host sync per layer, for the counts); rows past an expert's count are never read back;
3. ``low_latency_combine(out, topk_idx, topk_weights, handle)`` sends each row back and adds the
   weighted rows per token on its own rank, in slot order in float32: deterministic, but not the
   single-process experts' order of bfloat16 additions.
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.expert_parallel.deepep_dispatch import deepep_topk_idx
from pdserve.expert_parallel.dispatch import DispatchStats, ExpertShard, LocalExperts


class DeepEpLowLatencyDispatch:
    def __init__(
        self,
        shard: ExpertShard,
        buffer: Any,
        index_dtype: torch.dtype,
        max_tokens: int,
        stats: DispatchStats | None = None,
    ) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.num_experts = shard.num_experts
        self.max_tokens = max_tokens
        self._buffer = buffer
        self._index_dtype = index_dtype
        self.stats = stats or DispatchStats()

    def __call__(
        self,
        experts: LocalExperts,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        if hidden_states.shape[0] > self.max_tokens:
            raise ValueError(
                f"{hidden_states.shape[0]} tokens exceed the low-latency buffer's {self.max_tokens} per rank"
            )
        topk_idx = deepep_topk_idx(top_k_index, self.num_experts, self._index_dtype)
        recv_x, recv_count, handle, _, _ = self._buffer.low_latency_dispatch(
            hidden_states.contiguous(), topk_idx, self.max_tokens, self.num_experts, use_fp8=False
        )
        out = self.run_local(experts, recv_x, recv_count)
        combined, _, _ = self._buffer.low_latency_combine(
            out, topk_idx, top_k_weights.to(torch.float32).contiguous(), handle
        )
        result: torch.Tensor = combined
        return result

    def run_local(
        self, experts: LocalExperts, recv_x: torch.Tensor, recv_count: torch.Tensor
    ) -> torch.Tensor:
        """``recv_x``'s shape: each local expert's output on its received rows, zeros elsewhere."""
        per_expert = recv_count.tolist()
        self.stats.count(per_expert)
        out = torch.zeros_like(recv_x)
        most = max(per_expert, default=0)
        if most:
            out[:, :most] = experts.run_all(recv_x[:, :most]).to(out.dtype)
        return out
