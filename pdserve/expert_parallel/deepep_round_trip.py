"""A start-up round of a DeepEP dispatch: known tokens out and back through identity experts.

Every rank of the group runs it at the same time. Each sends ``num_tokens`` tokens filled with
``rank + 1``; token ``t`` goes to one expert on each of ``min(top_k, size)`` ranks (the other slots
are masked) with weight 1, and the experts return their rows unchanged, so each token must come
back multiplied by its number of routes. The values are small integers, exact in bfloat16.
"""

from __future__ import annotations

import torch

from pdserve.expert_parallel.dispatch import Dispatch, ExpertShard


class RoundTripError(RuntimeError):
    """DeepEP's kernels ran but did not bring the tokens back as sent."""


class IdentityExperts:
    """Local experts that return their rows unchanged."""

    def run_expert(self, local_expert: int, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def run_all(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


def round_trip_routes(shard: ExpertShard, top_k: int, num_tokens: int) -> list[list[int]]:
    """Token ``t``'s expert ids: one on each of ranks ``t, t + 1, ...`` (mod size), then -1."""
    routes = min(top_k, shard.size)
    return [
        [((t + j) % shard.size) * shard.num_local + t % shard.num_local for j in range(routes)]
        + [-1] * (top_k - routes)
        for t in range(num_tokens)
    ]


def round_trip(
    dispatch: Dispatch, shard: ExpertShard, top_k: int, hidden: int, device: torch.device, num_tokens: int = 2
) -> None:
    """Runs the round through ``dispatch``; raises ``RoundTripError`` when a token came back wrong."""
    x = torch.full((num_tokens, hidden), float(shard.rank + 1), dtype=torch.bfloat16, device=device)
    index = torch.tensor(round_trip_routes(shard, top_k, num_tokens), dtype=torch.long, device=device)
    weights = torch.ones((num_tokens, top_k), dtype=torch.bfloat16, device=device)
    got = dispatch(IdentityExperts(), x, index, weights)
    want = x * min(top_k, shard.size)
    if got.shape != want.shape or not torch.equal(got, want):
        wrong = (got != want).any(dim=-1).nonzero().flatten().tolist() if got.shape == want.shape else "all"
        raise RoundTripError(f"rank {shard.rank}: tokens {wrong} came back wrong")
