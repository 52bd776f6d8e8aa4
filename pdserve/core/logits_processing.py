"""The logits processors of one request, applied to its row of logits before ``sample``, as vLLM.

In vLLM's order, on float32 logits:
1. ``allowed_token_ids``: every other token is masked;
   ``bad_words``: the last token of each bad word's token sequence is masked where the output ends
   with the rest of it (a one-token word always);
2. ``min_tokens``: while fewer output tokens than that were generated, the end-of-sequence tokens
   (unless ``ignore_eos``) and ``stop_token_ids`` are masked;
3. ``logit_bias``: each bias is added to its token's logit;
4. the penalties: ``repetition_penalty`` divides the positive logits (multiplies the negative ones)
   of every token seen in the prompt or the output; ``frequency_penalty`` times a token's count in
   the output, and ``presence_penalty`` once for a token the output holds, are subtracted.
Greedy requests take the argmax of the result; others go on to ``sample`` (temperature, then
``min_p``, top-k and top-p there). ``min_p`` does not change the argmax: it is no processor here.

The prompt and the output are told apart because the penalties treat them differently. The prefill
knows the prompt and, for a resumed request, the output tokens at its end; the decode is given the
same tokens (``DecodeRequest.prompt_token_ids``) and its first token, and ``append`` counts each
token it samples after them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence

import torch

from pdserve.core.sampling import SamplingParams, sample


class LogitsProcessor:
    """One request's processors and the token counts they read. Tensors are made on the device of
    the first logits it sees."""

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Collection[int],
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        num_output: int | None = None,
    ) -> None:
        """``num_output``: the tokens generated so far (``len(output_ids)`` unless given: the
        output's ids are needed only by the penalties)."""
        self._params = params
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(eos_token_ids)
        self._stop_ids = sorted(stop)
        self._prompt_ids = list(prompt_ids) if params.repetition_penalty != 1 else []
        self._output_ids = list(output_ids)
        self._num_output = len(output_ids) if num_output is None else num_output
        self._built = False
        self._counts: torch.Tensor | None = None  # [vocab] occurrences in the output
        self._seen: torch.Tensor | None = None  # [vocab] in the prompt or the output
        self._allowed: torch.Tensor | None = None
        self._bias_ids: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._stop: torch.Tensor | None = None
        self._bad = params.bad_words_token_ids
        keep = max((len(sequence) - 1 for sequence in self._bad), default=0)
        self._tail = deque(self._output_ids[len(self._output_ids) - keep :] if keep else (), maxlen=keep)

    @classmethod
    def of_request(
        cls,
        params: SamplingParams,
        eos_token_ids: Collection[int],
        token_ids: Sequence[int],
        num_generated: int,
    ) -> LogitsProcessor:
        """The processor of a request whose KV holds ``token_ids``, the last ``num_generated`` of
        them generated (a resumed request), before its next token is sampled. ``token_ids`` may be
        empty when no penalty applies."""
        split = max(len(token_ids) - num_generated, 0)
        return cls(params, eos_token_ids, token_ids[:split], token_ids[split:], num_generated)

    @property
    def num_output(self) -> int:
        return self._num_output

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed float32 copy of one row of logits ``[vocab]``."""
        p = self._params
        if not self._built:
            self._build(logits.shape[-1], logits.device)
        scores = logits.float().clone()
        if self._allowed is not None:
            scores.masked_fill_(~self._allowed, float("-inf"))
        if self._bad:
            banned = self._banned()
            if banned:
                scores.index_fill_(
                    0, torch.tensor(banned, dtype=torch.long, device=scores.device), float("-inf")
                )
        if self._stop is not None and self._num_output < p.min_tokens:
            scores.index_fill_(0, self._stop, float("-inf"))
        if self._bias_ids is not None and self._bias is not None:
            scores.index_add_(0, self._bias_ids, self._bias)
        if self._seen is not None and p.repetition_penalty != 1:
            penalty = torch.where(self._seen, p.repetition_penalty, 1.0)
            scores = torch.where(scores > 0, scores / penalty, scores * penalty)
        if self._counts is not None and p.frequency_penalty != 0:
            scores -= p.frequency_penalty * self._counts
        if self._counts is not None and p.presence_penalty != 0:
            scores -= p.presence_penalty * (self._counts > 0)
        return scores

    def append(self, token_id: int) -> None:
        """``token_id`` was sampled: it is an output token from now on."""
        self._num_output += 1
        if self._tail.maxlen:
            self._tail.append(token_id)
        if not self._built:
            self._output_ids.append(token_id)
            return
        if self._counts is not None:
            self._counts[token_id] += 1
        if self._seen is not None:
            self._seen[token_id] = True

    def _banned(self) -> list[int]:
        """The bad words' last tokens that the output's end calls for (vLLM's rule: only output
        tokens count, so a word longer than the output so far plus one is never matched)."""
        tail = list(self._tail)
        banned = []
        for sequence in self._bad:
            prefix = len(sequence) - 1
            if prefix > min(self._num_output, len(tail)):
                continue
            if prefix == 0 or tail[len(tail) - prefix :] == list(sequence[:prefix]):
                banned.append(sequence[-1])
        return banned

    def _build(self, vocab_size: int, device: torch.device) -> None:
        p = self._params
        self._built = True
        if p.has_penalties:
            self._counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            if self._output_ids:
                ids = torch.tensor(self._output_ids, dtype=torch.long, device=device)
                self._counts.index_add_(0, ids, torch.ones(len(self._output_ids), device=device))
        if p.repetition_penalty != 1 and self._counts is not None:
            self._seen = self._counts > 0
            if self._prompt_ids:
                self._seen[torch.tensor(self._prompt_ids, dtype=torch.long, device=device)] = True
        self._prompt_ids = []
        self._output_ids = []
        if p.allowed_token_ids:
            self._allowed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self._allowed[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=device)] = True
        if p.logit_bias:
            self._bias_ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=device)
            self._bias = torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32, device=device)
        if p.min_tokens > 0 and self._stop_ids:
            stop = [t for t in self._stop_ids if t < vocab_size]
            self._stop = torch.tensor(stop, dtype=torch.long, device=device)


def pick(logits: torch.Tensor, params: SamplingParams, step: int, processor: LogitsProcessor | None) -> int:
    """The token of one row: processed when ``processor`` is given, then argmax or ``sample``."""
    if processor is not None:
        logits = processor.apply(logits)
    if params.is_greedy:
        return int(torch.argmax(logits).item())
    return sample(logits, params, step)


def request_processor(
    params: SamplingParams, eos_token_ids: Collection[int], token_ids: Sequence[int], num_generated: int
) -> LogitsProcessor | None:
    """``LogitsProcessor.of_request``, or None when no processor applies (the fast path)."""
    if not params.has_processors:
        return None
    return LogitsProcessor.of_request(params, eos_token_ids, token_ids, num_generated)
