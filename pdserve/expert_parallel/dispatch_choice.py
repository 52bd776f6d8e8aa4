"""The dispatch a rank's experts call: the all-to-all, or DeepEP's kernels once they passed their checks.

Every rank of a group must run the same kernels in the same MoE layer call (they are collectives).
The lockstep tells ``set_tick_tokens`` the most tokens any rank runs at the tick about to start (the
same number on every rank), and each call picks by it:
- before ``use`` (or when DeepEP is not used at all): the all-to-all dispatch;
- the low-latency kernels when the service has them and every rank's forward fits their buffer
  (a decode step: at most ``--max-running`` tokens), so a decode service always runs them and a
  colocated one runs them for its decode steps;
- DeepEP's normal kernels otherwise (prefill forwards, and every forward of a prefill service).
"""

from __future__ import annotations

import torch

from pdserve.expert_parallel.dispatch import Dispatch, DispatchStats, LocalExperts

UNKNOWN_TOKENS = 1 << 62  # a forward whose size the lockstep was not told


class DispatchChoice:
    def __init__(self, fallback: Dispatch) -> None:
        self._fallback = fallback
        self.stats: DispatchStats = fallback.stats
        self._normal: Dispatch | None = None
        self._low_latency: Dispatch | None = None
        self._low_latency_tokens = 0
        self.tick_tokens = UNKNOWN_TOKENS
        self.kernels = "all-to-all"

    def use(self, normal: Dispatch, low_latency: Dispatch | None = None, low_latency_tokens: int = 0) -> None:
        """From now on: ``normal``, or ``low_latency`` at ticks of at most ``low_latency_tokens`` per rank."""
        self._normal, self._low_latency, self._low_latency_tokens = normal, low_latency, low_latency_tokens
        self.kernels = "deepep" + ("+low-latency" if low_latency is not None else "")

    def set_tick_tokens(self, tokens: int) -> None:
        self.tick_tokens = tokens

    def worst_tokens(self, size: int) -> int:
        """The most rows a rank can receive at this tick (0 when the tick's size is unknown)."""
        return 0 if self.tick_tokens >= UNKNOWN_TOKENS else size * self.tick_tokens

    def __call__(
        self,
        experts: LocalExperts,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        return self._pick()(experts, hidden_states, top_k_index, top_k_weights)

    def _pick(self) -> Dispatch:
        if self._normal is None:
            return self._fallback
        if self._low_latency is not None and self.tick_tokens <= self._low_latency_tokens:
            return self._low_latency
        return self._normal
