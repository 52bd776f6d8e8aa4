"""Dispatch/combine with ``torch.distributed.all_to_all_single`` and uneven splits (gloo or NCCL).

Rank ``r`` holds experts ``[r * E_local, (r + 1) * E_local)``. One MoE layer call on every rank:
1. each (token, k) pair is ordered by expert id (stable), which also groups it by owner rank;
2. the per-expert counts are exchanged (equal splits of ``E_local``), so each rank learns how many
   rows it receives from each source and for which of its experts;
3. the rows' hidden states travel to their owners (uneven splits, zeros included);
4. each owner runs each of its experts once over the rows it received;
5. the outputs travel back the same way reversed, and each rank weights them and adds them up per
   token in expert order (``expert_order``), the additions of the single-process eager experts,
   so the output equals theirs bit for bit whenever each expert's rows come out the same.
Ids outside ``[0, E)`` (masked routes) are skipped. A rank may send or receive zero rows; every rank
still takes part in every exchange, so the group stays in step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pdserve.expert_parallel.dispatch import DispatchStats, ExpertShard, LocalExperts
from pdserve.expert_parallel.expert_order import expert_keys, sum_in_expert_order


class AllToAllDispatch:
    def __init__(
        self,
        shard: ExpertShard,
        group: dist.ProcessGroup | None = None,
        stats: DispatchStats | None = None,
    ) -> None:
        self.size = shard.size
        self.num_experts = shard.num_experts
        self.num_local = shard.num_local
        self._group = group
        self.stats = stats or DispatchStats()

    def __call__(
        self,
        experts: LocalExperts,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        keys = expert_keys(top_k_index, self.num_experts)
        order = torch.argsort(keys.reshape(-1), stable=True)
        routed = int((keys < self.num_experts).sum())
        order = order[:routed]
        per_expert = torch.bincount(keys.reshape(-1)[order], minlength=self.num_experts)
        recv_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(recv_per_expert, per_expert, group=self._group)
        recv_counts = recv_per_expert.view(self.size, self.num_local)
        send_splits = per_expert.view(self.size, self.num_local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()

        tokens = order // keys.shape[1]
        received = hidden_states.new_empty((sum(recv_splits), hidden_states.shape[-1]))
        dist.all_to_all_single(
            received, hidden_states[tokens].contiguous(), recv_splits, send_splits, group=self._group
        )
        outputs = self._run_local(experts, received, recv_counts)
        returned = hidden_states.new_empty((routed, hidden_states.shape[-1]))
        dist.all_to_all_single(returned, outputs, send_splits, recv_splits, group=self._group)

        weighted = (returned * top_k_weights.reshape(-1)[order][:, None]).to(hidden_states.dtype)
        return sum_in_expert_order(weighted, order, keys)

    def _run_local(
        self, experts: LocalExperts, received: torch.Tensor, recv_counts: torch.Tensor
    ) -> torch.Tensor:
        """Each local expert once over its rows; rows from each source come grouped by expert."""
        per_expert = recv_counts.sum(0).tolist()
        self.stats.count(per_expert)
        outputs = torch.empty_like(received)
        if received.shape[0] == 0:
            return outputs
        local_ids = torch.repeat_interleave(
            torch.arange(self.num_local, device=received.device).repeat(self.size), recv_counts.reshape(-1)
        )
        by_expert = torch.argsort(local_ids, stable=True)
        start = 0
        for expert, count in enumerate(per_expert):
            if count == 0:
                continue
            rows = by_expert[start : start + count]
            start += count
            outputs[rows] = experts.run_expert(expert, received[rows]).to(outputs.dtype)
        return outputs
