"""Dispatch/combine with ``torch.distributed.all_to_all_single`` and uneven splits (gloo or NCCL).

Rank ``r`` holds experts ``[r * E_local, (r + 1) * E_local)``. One MoE layer call on every rank:
1. each (token, k) pair is ordered by expert id (stable), which also groups it by owner rank;
2. the per-expert counts are exchanged (equal splits of ``E_local``), so each rank learns how many
   rows it receives from each source and for which of its experts;
3. the rows' hidden states travel to their owners (uneven splits, zeros included);
4. each owner runs each of its experts once over the rows it received;
5. the outputs travel back the same way reversed, and each rank weights them and adds them up per
   token in expert order, as the single-process eager experts do.
Ids ``>= E`` (masked routes) are skipped. A rank may send or receive zero rows; every rank still
takes part in every exchange, so the group stays in step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pdserve.expert_parallel.dispatch import DispatchStats, ExpertShard, LocalExperts


class AllToAllDispatch:
    def __init__(self, shard: ExpertShard, group: dist.ProcessGroup | None = None) -> None:
        self.size = shard.size
        self.num_experts = shard.num_experts
        self.num_local = shard.num_local
        self._group = group
        self.stats = DispatchStats()

    def __call__(
        self,
        experts: LocalExperts,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sorted_ids = flat[order]
        routed = int((sorted_ids < self.num_experts).sum())
        order, sorted_ids = order[:routed], sorted_ids[:routed]
        per_expert = torch.bincount(sorted_ids, minlength=self.num_experts)
        recv_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(recv_per_expert, per_expert, group=self._group)
        recv_counts = recv_per_expert.view(self.size, self.num_local)
        send_splits = per_expert.view(self.size, self.num_local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()

        tokens = order // top_k
        received = hidden_states.new_empty((sum(recv_splits), hidden_states.shape[-1]))
        dist.all_to_all_single(
            received, hidden_states[tokens].contiguous(), recv_splits, send_splits, group=self._group
        )
        outputs = self._run_local(experts, received, recv_counts)
        returned = hidden_states.new_empty((routed, hidden_states.shape[-1]))
        dist.all_to_all_single(returned, outputs, send_splits, recv_splits, group=self._group)

        weights = top_k_weights.reshape(-1)[order]
        out = torch.zeros_like(hidden_states)
        out.index_add_(0, tokens, (returned * weights[:, None]).to(out.dtype))
        return out

    def _run_local(
        self, experts: LocalExperts, received: torch.Tensor, recv_counts: torch.Tensor
    ) -> torch.Tensor:
        """Each local expert once over its rows; rows from each source come grouped by expert."""
        self.stats.calls += 1
        outputs = torch.empty_like(received)
        if received.shape[0] == 0:
            self.stats.idle_ranks += 1
            self.stats.idle_experts += self.num_local
            return outputs
        local_ids = torch.repeat_interleave(
            torch.arange(self.num_local, device=received.device).repeat(self.size), recv_counts.reshape(-1)
        )
        by_expert = torch.argsort(local_ids, stable=True)
        start = 0
        for expert, count in enumerate(recv_counts.sum(0).tolist()):
            if count == 0:
                self.stats.idle_experts += 1
                continue
            rows = by_expert[start : start + count]
            start += count
            outputs[rows] = experts.run_expert(expert, received[rows]).to(outputs.dtype)
        return outputs
