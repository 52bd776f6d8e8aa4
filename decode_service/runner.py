"""One decode step's forward: from the running rows to one sampled token per row.

1. the batch contexts take the rows (``batch_tiers``; each a ``step_cache.BatchContext``): a
   joining row's KV is copied in from its blocks, a leaving row's place taken by the last row; the
   step runs the short tier's rows in its context's order, then the long tier's (a few rows much
   longer than the rest, when the runner may split rows by length);
2. each row feeds its last token at its own position (its cached length), writes that position's
   KV to its pool slot, and attends to its own positions up to that one (the rest of the longest
   row's length is masked);
3. one forward of all rows through ``EngineModel.forward`` over a ``StepCache``; when the rows
   leave the positions they share to the batch context's shared prefix (its base, when the runner
   may), the forward attends to that prefix once for all rows and to each row's positions after
   it (``pdserve.model.shared_prefix_attention``); with a long tier, each tier attends over its
   own positions in a call of its own (``pdserve.model.ragged_attention``);
4. each row's token: the first maximum of its logits when greedy, else ``sample`` at its own step;
   a row whose request asks for logprobs gets its token's from the same logits
   (``pdserve.core.logprobs``; a step of rows that ask none computes none).
   a row with a structured output has its grammar's mask applied to its logits first.
   a row with logits processors (``pdserve.core.logits_processing``) has them applied first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decode_service.batch_tiers import BatchTiers
from decode_service.kv_pool import KvPool
from decode_service.sequence import DecodeSequence
from decode_service.step_cache import LongTier, StepCache, StepLayer
from pdserve.core.grammar import apply_masks
from pdserve.core.logits_processing import LogitsProcessor, pick
from pdserve.core.logprobs import TokenLogprobs, rows_logprobs
from pdserve.core.sampling import sample
from pdserve.model.engine_model import EngineModel
from pdserve.model.ragged_attention import RaggedRows
from pdserve.model.shared_prefix_attention import SharedPrefix


@dataclass(frozen=True)
class StepOutput:
    rows: list[DecodeSequence]  # in the order the step ran them
    token_ids: list[int]  # the token sampled for each row
    # Each row's token's logprobs (None for a row that asks none); empty when no row asks.
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    shared_prefix_tokens: int = 0  # positions of every row the step attended to once for all
    long_rows: int = 0  # rows the step attended to apart from the short ones (the long tier)


class StepRunner:
    def __init__(
        self,
        engine_model: EngineModel,
        pool: KvPool,
        max_rows: int,
        shared_prefix: bool = False,
        ragged: bool = False,
    ) -> None:
        """``shared_prefix``: the model runs ``shared_prefix_attention`` and steps may attend to a
        prefix their rows share once; ``ragged``: it runs it and steps may split rows by length."""
        self._m = engine_model
        self._pool = pool
        self._tiers = BatchTiers(pool, max_rows, engine_model.limits.max_model_len, ragged, shared_prefix)
        self._mask_value = torch.finfo(engine_model.kv_layout.dtype).min

    def run(self, rows: Sequence[DecodeSequence]) -> StepOutput:
        ordered = self._arrange(rows)
        tiers = self._tiers
        shared = tiers.short.shared_length()  # 0 with a long tier, or without shared-prefix attention
        logits = self._forward(ordered, shared)
        counts = [seq.params.logprobs for seq in ordered]
        wanted = any(count is not None for count in counts)
        masked = any(seq.grammar is not None for seq in ordered)
        raw = logits.clone() if wanted and masked else logits  # logprobs are the model's, unmasked
        tokens = self._sample(logits, ordered)
        logprobs = rows_logprobs(raw, tokens, counts) if wanted else []
        return StepOutput(ordered, tokens, logprobs, shared, tiers.num_long)

    def clear(self) -> None:
        """Forgets the rows of the batch contexts (nothing runs, or other rows will)."""
        self._tiers.clear()

    def release(self) -> None:
        """Forgets the rows and frees the batch contexts' memory beyond the reservation."""
        self._tiers.release()

    def reserve(self, rows: int, positions: int) -> None:
        """Allocates the short rows' batch context for ``rows`` rows of ``positions`` now and keeps it."""
        self._tiers.short.reserve(rows, positions)

    @property
    def context_bytes(self) -> int:
        return self._tiers.num_bytes

    def _arrange(self, rows: Sequence[DecodeSequence]) -> list[DecodeSequence]:
        """Syncs the batch contexts to ``rows``; the rows in the step's order."""
        order = self._tiers.sync(
            [s.serial for s in rows], [s.blocks for s in rows], [s.num_cached for s in rows]
        )
        return [rows[i] for i in order]

    def _forward(self, rows: Sequence[DecodeSequence], shared: int) -> torch.Tensor:
        """The last position's logits of each row, ``[rows, vocab]``, the rows in the tiers' order;
        ``shared``: the first positions of every row to attend to once, from the short tier's shared
        prefix (0: none; only without a long tier)."""
        device = self._m.device
        short = self._tiers.num_short
        lengths = torch.tensor([s.num_cached for s in rows], dtype=torch.long)
        length = int(lengths.max()) + 1
        short_length = int(lengths[:short].max()) + 1
        write = torch.tensor([self._pool.slot(s.blocks, s.num_cached) for s in rows], dtype=torch.long)
        lengths_d = lengths.to(device)
        mask = self._mask(lengths, length, shared).to(device)
        cache = self._cache(write.to(device), lengths_d, short, short_length, length, shared)
        extra: dict[str, SharedPrefix | RaggedRows] = {}
        if shared:
            context = self._tiers.short
            extra["shared_prefix"] = SharedPrefix(
                [k[:, :shared] for k in context.prefix.keys], [v[:, :shared] for v in context.prefix.values]
            )
        elif short < len(rows):
            extra["ragged"] = RaggedRows(
                mask[:short, ..., :short_length].clone(),
                mask[short:].clone(),
                torch.arange(short, device=device),
                torch.arange(short, len(rows), device=device),
                cache.step_layers,
            )
        out = self._m.forward(
            input_ids=torch.tensor([[s.last_token_id] for s in rows], dtype=torch.long, device=device),
            position_ids=lengths_d[:, None],
            attention_mask=mask,
            cache=cache,
            use_cache=True,
            **extra,
        )
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    def _mask(self, lengths: torch.Tensor, length: int, start: int = 0) -> torch.Tensor:
        """``[rows, 1, 1, length - start]``: 0 where a row attends (its positions from ``start`` up to
        its new one), else min."""
        valid = torch.arange(start, length)[None, :] <= lengths[:, None]
        mask = torch.zeros((len(lengths), 1, 1, length - start), dtype=self._pool.layout.dtype)
        mask.masked_fill_(~valid[:, None, None, :], self._mask_value)
        return mask

    def _cache(
        self,
        write: torch.Tensor,
        lengths: torch.Tensor,
        short: int,
        short_length: int,
        long_length: int,
        start: int,
    ) -> StepCache:
        """The step's cache: the short tier's first ``short`` rows attend over ``short_length``
        positions from ``start``; the rows after them are the long tier's, over ``long_length``."""
        pool, tiers = self._pool, self._tiers
        rows = len(lengths)
        short_positions = lengths[:short] - start if start else lengths[:short]  # in the rows
        tier_rows = torch.arange(rows - short, device=lengths.device)
        steps = torch.arange(short, rows, device=lengths.device)

        def long_tier(layer: int) -> LongTier | None:
            if short == rows:
                return None
            keys, values = tiers.long.keys[layer][: rows - short], tiers.long.values[layer][: rows - short]
            return LongTier(keys, values, tier_rows, steps, lengths[short:], long_length)

        return StepCache(
            [
                StepLayer(
                    pool.keys[i],
                    pool.values[i],
                    tiers.short.keys[i][:short],
                    tiers.short.values[i][:short],
                    write,
                    short_positions,
                    short_length,
                    start,
                    long_tier(i),
                )
                for i in range(pool.layout.num_layers)
            ]
        )

    def _sample(self, logits: torch.Tensor, rows: Sequence[DecodeSequence]) -> list[int]:
        if any(seq.grammar is not None for seq in rows):
            apply_masks(logits, [seq.grammar for seq in rows])
        greedy = logits.max(dim=-1).indices.tolist()  # the first maximum, as argmax; faster on CPU
        tokens = [
            int(greedy[i]) if seq.params.is_greedy else sample(logits[i], seq.params, step=seq.num_generated)
            for i, seq in enumerate(rows)
            if seq.processor is None
        ]
        if len(tokens) == len(rows):
            return tokens
        fast = iter(tokens)
        return [
            next(fast) if seq.processor is None else _processed(logits[i], seq, seq.processor)
            for i, seq in enumerate(rows)
        ]


def _processed(logits: torch.Tensor, seq: DecodeSequence, processor: LogitsProcessor) -> int:
    """The token of a row with logits processors, which then count it."""
    token = pick(logits, seq.params, seq.num_generated, processor)
    processor.append(token)
    return token
