"""Adding each token's expert contributions in one fixed order: increasing expert id.

The single-process eager experts (``DeepseekMoeExperts.forward``) start from zeros and add every
expert's weighted output in expert-id order, one ``index_add_`` per expert (a token at most once per
call; a token that picked an expert twice gets both rows in slot order, added one by one in float32
and in one float32 sum in bfloat16 on the CPU). ``sum_in_expert_order`` makes the same sequence of
additions (one by one), whatever order the contributions were computed in, without
atomics: CUDA's ``index_add_`` over duplicate indices adds them in any order, so the result could
change from run to run. Step ``j`` adds every token's ``j``-th contribution in expert order, or an
exact zero for a token with fewer routes, so each token's sum is ``((0 + c_1) + c_2) + ...``.
"""

from __future__ import annotations

import torch


def expert_keys(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``expert_ids`` as int64 with every id outside ``[0, num_experts)`` (masked, -1) set to ``num_experts``."""
    ids = expert_ids.long()
    return torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)


def sum_in_expert_order(values: torch.Tensor, routes: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[T, H]``: zeros plus, in increasing key order (ties in slot order), token ``t``'s values.

    ``values[i]`` is the contribution of flat route ``routes[i]`` (``token * k + slot``) of
    ``keys [T, k]``; each route has at most one row, and routes without one add nothing.
    """
    if values.dim() != 2 or routes.shape != values.shape[:1]:
        raise ValueError(
            f"values [N, H] and routes [N] expected, got {tuple(values.shape)}, {tuple(routes.shape)}"
        )
    num_tokens, top_k = keys.shape
    out = values.new_zeros((num_tokens, values.shape[1]))
    if values.shape[0] == 0:
        return out
    device = values.device
    row_of = torch.full((num_tokens * top_k,), -1, dtype=torch.long, device=device)
    row_of[routes] = torch.arange(values.shape[0], device=device)
    by_key = torch.argsort(keys, dim=1, stable=True)
    first = torch.arange(num_tokens, device=device) * top_k
    for j in range(top_k):
        row = row_of[first + by_key[:, j]]
        out = out + values[row.clamp(min=0)].masked_fill((row < 0)[:, None], 0)
    return out
