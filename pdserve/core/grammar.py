"""Structured output as a token mask: ``StructuredOutput`` -> grammar -> one matcher per request.

Grammars are llguidance's (JSON schema, regex, a Lark rule for choices). The pieces:
- ``grammar_of`` compiles and validates a spec without a tokenizer (the gateway's and the
  services' input check); bad input raises ``ValueError`` naming the field;
- ``Grammars`` (one per engine process) holds the tokenizer's llguidance view, built on first use,
  and a bounded cache of one fresh matcher per spec; ``start`` copies that matcher and advances it
  over the tokens the request generated before (a resumed request's), so that the state of a
  request is the same wherever it runs: on the prefill for its first token, on a decode for the rest;
- ``GrammarState`` is one request's matcher: ``apply_masks`` sets the logits of the tokens it does
  not allow to -inf before sampling (EOS is allowed only where the grammar may end, and never under
  ``ignore_eos``), ``advance`` takes the token sampled, and ``finish_reason`` ends the request with
  ``stop`` once the grammar accepts and can only end.
Requests without a structured output never reach any of this.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import threading
from collections.abc import Collection, Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch

from pdserve.core.finish import LENGTH, STOP
from pdserve.core.structured_output import CHOICE, JSON, JSON_OBJECT, REGEX, StructuredOutput

logger = logging.getLogger(__name__)

MAX_ERROR_CHARS = 300
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_SHIFTS = torch.arange(32, dtype=torch.int32)


@functools.lru_cache(maxsize=256)
def grammar_of(output: StructuredOutput) -> str:
    """The llguidance grammar of ``output``, validated; ValueError names the field."""
    field = f"structured_output.{output.kind}"
    try:
        if output.kind == JSON:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                output.spec, defaults={"whitespace_flexible": output.any_whitespace}
            )
        elif output.kind == JSON_OBJECT:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults={"whitespace_flexible": output.any_whitespace}
            )
        elif output.kind == REGEX:
            grammar = llguidance.LLMatcher.grammar_from_regex(output.spec)
        else:
            assert output.kind == CHOICE
            grammar = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in output.choices)
            )
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{field} is not valid: {_short(str(exc))}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=_LIMITS)
    if error:
        raise ValueError(f"{field} is not valid: {_short(error)}")
    return grammar


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int, blocked: Sequence[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.blocked = list(blocked)  # never allowed (EOS under ignore_eos)

    def fill(self, bitmask: torch.Tensor) -> None:
        """Writes the allowed tokens into ``bitmask`` (one int32 row, a bit per token)."""
        self._matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())

    def copy(self) -> GrammarState:
        """An independent state at the same position (another choice of the same request)."""
        return GrammarState(self._matcher.deep_copy(), self.vocab_size, self.blocked)

    def advance(self, token_id: int) -> None:
        if not self._matcher.consume_token(token_id):
            logger.warning("structured output: the grammar refused token %d: %s", token_id, self.error)

    @property
    def done(self) -> bool:
        """Whether the grammar can take no more tokens (its output is complete, or it failed)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return _short(self._matcher.get_error())

    def finish_reason(self, reason: str | None) -> str | None:
        """The request's finish reason after its last token, given the token rules' ``reason``:
        ``stop`` when the grammar is complete and the token rules would go on or end at the length."""
        if (reason is None or reason == LENGTH) and self.done:
            return STOP
        return reason


def apply_masks(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
    """Sets ``logits[i]`` (``[rows, vocab]``) to -inf at every token ``states[i]`` does not allow;
    rows without a state are left as they are."""
    rows = [i for i, state in enumerate(states) if state is not None]
    if not rows:
        return
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
    for j, i in enumerate(rows):
        state = states[i]
        assert state is not None
        state.fill(bitmask[j, : (state.vocab_size + 31) // 32])
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    for j, i in enumerate(rows):
        state = states[i]
        assert state is not None
        if state.blocked:
            allowed[j, state.blocked] = False
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))


class Grammars:
    """The matchers of one tokenizer: built on first use, one fresh matcher cached per spec."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int], cache_size: int = 64
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"the grammar cache needs room for one grammar, got {cache_size}")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._fresh: collections.OrderedDict[StructuredOutput, Any] = collections.OrderedDict()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def start(self, output: StructuredOutput, generated: Sequence[int], ignore_eos: bool) -> GrammarState:
        """A request's state after ``generated`` (the tokens it generated before, in order).
        ValueError when the spec is not valid or the grammar refuses those tokens. May take long
        (the first call builds the tokenizer's view; a new spec compiles): call it off the event loop."""
        matcher = self._fresh_matcher(output).deep_copy()
        for i, token in enumerate(generated):
            if not matcher.consume_token(token):
                raise ValueError(
                    f"the generated token {i} ({token}) does not match structured_output.{output.kind}"
                )
        matcher.compute_bitmask()  # the lexer's first states are built here, not on the engine's thread
        return GrammarState(matcher, self._vocab_size, self._eos if ignore_eos else ())

    def _fresh_matcher(self, output: StructuredOutput) -> Any:
        grammar = grammar_of(output)
        with self._lock:
            matcher = self._fresh.get(output)
            if matcher is not None:
                self._fresh.move_to_end(output)
                return matcher
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self._vocab_size, eos_token=self._eos or None
                )
            matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0, limits=_LIMITS)
            if matcher.is_error():
                raise ValueError(
                    f"structured_output.{output.kind} is not valid: {_short(matcher.get_error())}"
                )
            self._fresh[output] = matcher
            while len(self._fresh) > self._cache_size:
                self._fresh.popitem(last=False)
            return matcher


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."
