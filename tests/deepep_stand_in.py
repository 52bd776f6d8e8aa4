"""Stand-ins for DeepEP's ``Buffer`` (no GPU): fixed results in the shapes and dtypes of the pinned commit.

The commit is the Dockerfile's ``DEEPEP_REF`` (567632dd59810d77b3cc05553df953cc0f779799), ``deep_ep/buffer.py``:
- ``get_dispatch_layout(topk_idx, E)`` (:293-320): ``num_tokens_per_rank [R]`` int32, ``None`` (one node),
  ``num_tokens_per_expert [E]`` int32, ``is_token_in_rank [T, R]`` bool, an event;
- ``dispatch(x, ..., num_worst_tokens=W)`` (:322-403, ``csrc/deep_ep.cpp`` :653-672): ``recv_x [N, H]`` in
  ``x``'s dtype, ``recv_topk_idx [N, k]`` in ``topk_idx``'s dtype (local expert ids, -1 elsewhere),
  ``recv_topk_weights [N, k]`` float32, the per-local-expert counts as a list (empty when ``W > 0``, and
  then ``N == W`` with rows past the received ones all -1), a handle, an event;
- ``combine(x [N, H], handle)`` (:405-451): ``[T, H]``, ``None``, an event;
- ``low_latency_dispatch(x, topk_idx, max_tokens, E, use_fp8=False)`` (:548-615, ``deep_ep.cpp``
  :1588-1592): ``recv_x [E_local, R * max_tokens, H]`` bfloat16, ``recv_count [E_local]`` int32, a handle
  of 5, an event, a hook;
- ``low_latency_combine(x, topk_idx, topk_weights, handle)`` (:617-661): ``[T, H]``, an event, a hook.

``simulate`` works out what each rank of a group would receive (tokens in source-rank order, as the
intranode kernels deliver them) and what the combine adds back, so the stand-ins can be fed a group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

INDEX_DTYPE = torch.int64  # deep_ep.topk_idx_t with the default EP_NUM_TOPK_IDX_BITS / TOPK_IDX_BITS (64)


@dataclass
class Routed:
    """One rank's tokens: hidden ``[T, H]``, global expert ids ``[T, k]`` (-1 masked), weights ``[T, k]``."""

    hidden: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor


@dataclass
class Received:
    """What DeepEP's normal dispatch hands one rank, and where each row came from."""

    recv_x: torch.Tensor
    recv_idx: torch.Tensor
    recv_weights: torch.Tensor
    per_expert: list[int]
    sources: list[tuple[int, int]]  # (source rank, token) per row


def simulate(inputs: list[Routed], num_experts: int, worst: int = 0) -> list[Received]:
    size = len(inputs)
    local = num_experts // size
    out = []
    for rank in range(size):
        rows, idx, weights, sources = [], [], [], []
        for src, routed in enumerate(inputs):
            for t in range(routed.ids.shape[0]):
                ids = routed.ids[t]
                mine = (ids >= rank * local) & (ids < (rank + 1) * local)
                if mine.any():
                    rows.append(routed.hidden[t])
                    idx.append(torch.where(mine, ids - rank * local, -1))
                    weights.append(routed.weights[t].float())
                    sources.append((src, t))
        hidden, top_k = inputs[0].hidden.shape[1], inputs[0].ids.shape[1]
        recv_x = torch.stack(rows) if rows else torch.zeros((0, hidden), dtype=inputs[0].hidden.dtype)
        recv_idx = torch.stack(idx).to(INDEX_DTYPE) if idx else torch.zeros((0, top_k), dtype=INDEX_DTYPE)
        recv_w = torch.stack(weights) if weights else torch.zeros((0, top_k))
        per_expert = [int((recv_idx == e).sum()) for e in range(local)]
        if worst:
            pad = worst - recv_x.shape[0]
            recv_x = torch.cat([recv_x, torch.full((pad, hidden), float("nan"), dtype=recv_x.dtype)])
            recv_idx = torch.cat([recv_idx, torch.full((pad, top_k), -1, dtype=INDEX_DTYPE)])
            recv_w = torch.cat([recv_w, torch.zeros((pad, top_k))])
            per_expert = []
        out.append(Received(recv_x, recv_idx, recv_w, per_expert, sources))
    return out


@dataclass
class NormalBuffer:
    """One rank's ``Buffer`` for the normal kernels, returning ``received``; records what it was given."""

    received: Received
    size: int
    num_experts: int
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    combined_input: torch.Tensor | None = None

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> tuple[Any, ...]:
        self.calls.append(("get_dispatch_layout", {"topk_idx": topk_idx, "num_experts": num_experts}))
        local = num_experts // self.size
        owner = torch.where(topk_idx >= 0, topk_idx // local, -1)
        in_rank = torch.stack([(owner == r).any(dim=1) for r in range(self.size)], dim=1)
        per_rank = in_rank.sum(0).to(torch.int32)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).to(torch.int32)
        return per_rank, None, per_expert, in_rank, object()

    def dispatch(self, x: torch.Tensor, **kwargs: Any) -> tuple[Any, ...]:
        self.calls.append(("dispatch", {"x": x, **kwargs}))
        r = self.received
        return r.recv_x, r.recv_idx, r.recv_weights, list(r.per_expert), ("handle",), object()

    def combine(self, x: torch.Tensor, handle: Any) -> tuple[Any, ...]:
        self.calls.append(("combine", {"x": x, "handle": handle}))
        self.combined_input = x
        return x, None, object()


def combine_normal(
    received: list[Received], partials: list[torch.Tensor], inputs: list[Routed]
) -> list[torch.Tensor]:
    """What DeepEP's combine gives each source rank: every rank's partial row added, in rank order."""
    out = [torch.zeros_like(r.hidden, dtype=torch.float32) for r in inputs]
    for rec, partial in zip(received, partials, strict=True):
        for row, (src, t) in enumerate(rec.sources):
            out[src][t] += partial[row].float()
    return [o.to(r.hidden.dtype) for o, r in zip(out, inputs, strict=True)]


@dataclass
class LowLatencyReceived:
    recv_x: torch.Tensor
    recv_count: torch.Tensor
    slots: list[list[tuple[int, int, int]]]  # per local expert, per row: (source rank, token, slot)


def simulate_low_latency(inputs: list[Routed], num_experts: int, max_tokens: int) -> list[LowLatencyReceived]:
    size = len(inputs)
    local = num_experts // size
    hidden = inputs[0].hidden.shape[1]
    out = []
    for rank in range(size):
        recv_x = torch.full((local, size * max_tokens, hidden), float("nan"), dtype=inputs[0].hidden.dtype)
        slots: list[list[tuple[int, int, int]]] = [[] for _ in range(local)]
        for src, routed in enumerate(inputs):
            for t in range(routed.ids.shape[0]):
                for k, e in enumerate(routed.ids[t].tolist()):
                    if rank * local <= e < (rank + 1) * local:
                        le = e - rank * local
                        recv_x[le, len(slots[le])] = routed.hidden[t]
                        slots[le].append((src, t, k))
        count = torch.tensor([len(s) for s in slots], dtype=torch.int32)
        out.append(LowLatencyReceived(recv_x, count, slots))
    return out


@dataclass
class LowLatencyBuffer:
    received: LowLatencyReceived
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    combined_input: torch.Tensor | None = None

    def low_latency_dispatch(
        self, x: torch.Tensor, topk_idx: torch.Tensor, max_tokens: int, num_experts: int, **kwargs: Any
    ) -> tuple[Any, ...]:
        self.calls.append(
            ("low_latency_dispatch", {"x": x, "topk_idx": topk_idx, "max_tokens": max_tokens, **kwargs})
        )
        handle = (None, None, max_tokens, x.shape[1], num_experts)
        return self.received.recv_x, self.received.recv_count, handle, object(), None

    def low_latency_combine(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: Any
    ) -> tuple[Any, ...]:
        self.calls.append(
            ("low_latency_combine", {"x": x, "topk_idx": topk_idx, "topk_weights": topk_weights})
        )
        self.combined_input = x
        return x, object(), None


def combine_low_latency(
    received: list[LowLatencyReceived], outputs: list[torch.Tensor], inputs: list[Routed]
) -> list[torch.Tensor]:
    """Per source token, its slots' rows weighted and added in slot order in float32, as the kernel does."""
    parts: dict[tuple[int, int, int], torch.Tensor] = {}
    for rec, out in zip(received, outputs, strict=True):
        for le, rows in enumerate(rec.slots):
            for row, key in enumerate(rows):
                parts[key] = out[le, row].float()
    result = []
    for src, routed in enumerate(inputs):
        combined = torch.zeros_like(routed.hidden, dtype=torch.float32)
        for t in range(routed.ids.shape[0]):
            for k in range(routed.ids.shape[1]):
                if (src, t, k) in parts:
                    combined[t] += parts[(src, t, k)] * float(routed.weights[t, k])
        result.append(combined.to(routed.hidden.dtype))
    return result
