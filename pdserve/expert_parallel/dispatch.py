"""What every dispatch/combine implementation provides to the expert-parallel experts forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ExpertShard:
    """Which routed experts a rank holds: ``[rank * num_local, (rank + 1) * num_local)``."""

    rank: int
    size: int
    num_experts: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")
        if self.num_experts % self.size:
            raise ValueError(f"{self.num_experts} experts do not split evenly over {self.size} ranks")

    @property
    def num_local(self) -> int:
        return self.num_experts // self.size


@dataclass
class DispatchStats:
    """Counts of the edge cases lockstep expert parallelism must survive (read by the metrics)."""

    calls: int = 0
    idle_experts: int = 0  # a local expert that received no token in one MoE layer call
    idle_ranks: int = 0  # this rank received no token at all in one MoE layer call

    def count(self, per_expert: list[int]) -> None:
        """One MoE layer call in which the local experts received ``per_expert`` rows."""
        self.calls += 1
        self.idle_experts += sum(1 for n in per_expert if n == 0)
        if not any(per_expert):
            self.idle_ranks += 1


class LocalExperts(Protocol):
    """The slice of one MoE layer's experts that a rank holds."""

    def run_expert(self, local_expert: int, hidden_states: torch.Tensor) -> torch.Tensor:
        """Local expert ``local_expert`` on ``hidden_states [N, H]``."""
        ...

    def run_all(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Every local expert ``e`` on ``hidden_states[e]``: ``[E_local, N, H]`` in, same shape out."""
        ...


class Dispatch(Protocol):
    stats: DispatchStats

    def __call__(
        self,
        experts: LocalExperts,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        """The routed experts' output ``[T, H]`` for this rank's tokens ``[T, H]``."""
        ...
