"""Attention over a prefix that every row of a batch shares, read once for all of them.

When the rows of a forward begin with the same KV (one system prompt, few-shot examples: the same
tokens' KV, bit for bit), attending to that prefix row by row reads it once per row: at 16 rows of a
1024-token prefix that is most of a decode step's time on a CPU, all of it memory traffic. Here the
prefix is attended once per KV head with the queries of every row as one matrix (a GEMM instead of
``rows`` memory-bound passes), each row's own part (its positions past the prefix) as usual, and
the two softmaxes are joined by their maxima and sums (``merge``; the cascade of FlashInfer and
Hydragen). The result is the attention over the whole context to float rounding.

The function is registered with transformers' attention interface under ``IMPLEMENTATION`` (with
the sdpa mask builder); a model switched to it (``use_shared_prefix_attention``) runs plain sdpa
(one query per row on a CPU: ``decode_attention``) unless a forward passes
``shared_prefix=SharedPrefix(...)``, whose tensors its cache layers then leave out of the keys and
values they return (the rows' own parts), or a decode step passes ``ragged=RaggedRows(...)``: rows
of very different lengths, split (``ragged_attention``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pdserve.model.compiled_forward import static_dims
from pdserve.model.decode_attention import attend_one_query, attention_forward
from pdserve.model.ragged_attention import RaggedRows, ragged_attention

logger = logging.getLogger(__name__)

IMPLEMENTATION = "pdserve_shared_prefix"
# Model types whose attention layers pass a forward's keyword arguments to the attention function.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


@dataclass(frozen=True)
class SharedPrefix:
    """The prefix every row of a forward shares: per layer ``[kv heads, tokens, width]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def __post_init__(self) -> None:
        for tensor in (*self.keys, *self.values):
            static_dims(tensor, 0, 2)  # heads and width: the model's (see ``static_dims``)

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[1]) if self.keys else 0


def use_shared_prefix_attention(model: Any) -> str | None:
    """Switches ``model`` to the shared-prefix attention; returns why not (then nothing changed), or
    None. The model must run sdpa attention and be of a type whose layers pass keyword arguments on."""
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"{model_type or 'this model type'} is not known to pass attention arguments on"
    current = getattr(config, "_attn_implementation", None)
    if current not in ("sdpa", IMPLEMENTATION):
        return f"the model runs {current} attention, not sdpa"
    AttentionInterface.register(IMPLEMENTATION, shared_prefix_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    model.set_attn_implementation(IMPLEMENTATION)
    return None


def enable_shared_prefix_attention(model: Any, off: bool, service: str) -> bool:
    """Whether ``service``'s forwards may read a KV prefix their rows share once (``off``: the
    ``--no-shared-prefix-attention`` setting); switches the model when they may, logs the choice."""
    if off:
        logger.info(
            "%s: rows attend to a shared KV prefix each on its own (--no-shared-prefix-attention)", service
        )
        return False
    reason = use_shared_prefix_attention(model)
    if reason is not None:
        logger.info("%s: rows attend to a shared KV prefix each on its own: %s", service, reason)
        return False
    logger.info("%s: a KV prefix the rows of a forward share is read once for all of them", service)
    return True


def enable_ragged_attention(model: Any, service: str) -> bool:
    """Whether ``service``'s decode steps may split rows of very different lengths
    (``ragged_attention``): the model runs this module's attention, switched to it here when it can
    be (a model left on sdpa by ``--no-shared-prefix-attention`` runs it as sdpa otherwise)."""
    reason = use_shared_prefix_attention(model)
    if reason is not None:
        logger.info("%s: every row of a step attends over the longest row's length: %s", service, reason)
        return False
    logger.info("%s: a step's few long rows attend apart from its short ones", service)
    return True


def shared_prefix_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    shared_prefix: SharedPrefix | None = None,
    ragged: RaggedRows | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function: sdpa without ``shared_prefix``; with it, ``key``/``value``
    are the rows' own parts ``[rows, kv heads, own, width]`` and ``attention_mask`` covers at least
    their positions (its last ``own`` ones are used). Returns ``[rows, queries, heads, width]``.
    ``ragged`` (without ``shared_prefix``): a decode step's rows split by length."""
    if shared_prefix is None and ragged is not None:
        return ragged_attention(module, query, key, value, ragged, dropout=dropout, scaling=scaling, **kwargs)
    if shared_prefix is None:
        out = attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out, None
    layer = int(getattr(module, "layer_idx", 0))
    output = attend(
        query, shared_prefix.keys[layer], shared_prefix.values[layer], key, value, attention_mask, scaling
    )
    return output.transpose(1, 2).contiguous(), None


def attend(
    query: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None = None,
) -> torch.Tensor:
    """Attention of ``query`` ``[rows, heads, queries, width]`` over a shared prefix (``[kv heads,
    prefix, width]``, seen by every query) followed by each row's own ``keys``/``values`` ``[rows, kv
    heads, own, width]`` under ``mask`` (additive or boolean, its last ``own`` positions; None:
    causal, the last query at the last position). Returns ``[rows, heads, queries, value width]``."""
    rows, heads, num_queries, width = query.shape
    kv_heads, own = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else width**-0.5
    # Every row's queries of one KV head, as one matrix: row, then group, then query.
    grouped = query.reshape(rows, kv_heads, groups * num_queries, width)
    flat = grouped.transpose(0, 1).reshape(1, kv_heads, rows * groups * num_queries, width)
    prefix_out, prefix_lse = _attention(flat, prefix_keys[None], prefix_values[None], None, scale)

    def per_row(
        t: torch.Tensor,
    ) -> torch.Tensor:  # [1, kv heads, rows * g * q, x] -> [rows, kv heads, g * q, x]
        return t.reshape(kv_heads, rows, groups * num_queries, t.shape[-1]).transpose(0, 1)

    own_mask = _own_mask(mask, query, rows, groups, num_queries, own)
    one_query = attend_one_query(query, keys, values, own_mask, scale) if num_queries == 1 else None
    if one_query is not None:  # a decode step on a CPU
        own_out = one_query[0].reshape(rows, kv_heads, groups, -1)
        own_lse = one_query[1].reshape(rows, kv_heads, groups)
    else:
        own_out, own_lse = _attention(grouped, keys, values, own_mask, scale)
    out = merge(per_row(prefix_out), per_row(prefix_lse[..., None]), own_out, own_lse[..., None])
    return out.reshape(rows, heads, num_queries, -1).to(query.dtype)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """The attention output over two disjoint sets of keys, from each set's output and the
    log-sum-exp of its scores."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    return (out_a.float() * weight_a + out_b.float() * weight_b) / (weight_a + weight_b)


def _attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and the log-sum-exp of each query's scores (float32); ``mask`` additive, in
    the query's dtype. On CPU, torch's flash kernel, which returns both."""
    if (
        query.device.type == "cpu"
        and keys.shape[-1] == values.shape[-1]
        and query.dtype in (torch.float32, torch.bfloat16)
    ):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, keys, values, 0.0, False, attn_mask=mask, scale=scale
        )
        return out, lse.float()
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, -1)
    weights = torch.exp(scores - lse[..., None])
    return torch.matmul(weights.to(values.dtype), values), lse


def _own_mask(
    mask: torch.Tensor | None, query: torch.Tensor, rows: int, groups: int, num_queries: int, own: int
) -> torch.Tensor | None:
    """The additive mask ``[rows or 1, 1, groups * queries, own]`` of the rows' own positions, at the
    dtype's minimum where masked (finite: a query that sees no own key then takes its whole weight
    from the prefix)."""
    lowest = torch.finfo(query.dtype).min
    if mask is None:
        if num_queries == 1:
            return None
        query_pos = torch.arange(num_queries, device=query.device)[:, None] + (own - num_queries)
        visible = torch.arange(own, device=query.device)[None, :] <= query_pos  # [queries, own]
        mask = visible[None, None]
    mask = mask[..., mask.shape[-1] - own :]  # [rows or 1, 1, queries or 1, own]
    if mask.shape[-2] != 1 and groups > 1:
        mask = mask[:, :, None].expand(mask.shape[0], 1, groups, num_queries, own)
        mask = mask.reshape(mask.shape[0], 1, groups * num_queries, own)
    if mask.dtype == torch.bool:
        additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        return additive.masked_fill(~mask, lowest)
    return torch.clamp(mask.to(query.dtype), min=lowest)
