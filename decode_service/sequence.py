"""A decode request as the engine holds it, and what a step tells it.

A ``DecodeSequence`` carries the KV pulled from the prefill until it is admitted, then the blocks
holding its context and its counts. Each step ends in one ``Emission`` per request it touched: its
new tokens, its finish reason or its error. ``deliver`` hands emissions to each sequence's ``emit``
on the sequence's event loop, one wake-up per loop for a whole step, or at once on the calling
thread for a sequence without a loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decode_service.kv_pool import PrefixBlocks
from pdserve.core.grammar import GrammarState
from pdserve.core.logits_processing import LogitsProcessor
from pdserve.core.logprobs import TokenLogprobs
from pdserve.core.sampling import SamplingParams

logger = logging.getLogger(__name__)


class DeadlineExpired(Exception):
    """The request's deadline passed before it finished."""

    def __init__(self) -> None:
        super().__init__("the request's deadline passed in decode")


# Called with each emission of a sequence: on its event loop when it names one, else on the engine thread.
EmitFn = Callable[["Emission"], None]


@dataclass(eq=False)
class DecodeSequence:
    request_id: str
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    first_token_id: int
    params: SamplingParams
    emit: EmitFn
    cancelled: threading.Event = field(default_factory=threading.Event)
    num_generated: int = 1  # tokens generated so far, the first one included (more when resumed)
    last_token_id: int = -1
    num_cached: int = 0  # positions whose KV is in the pool
    blocks: list[int] = field(default_factory=list)
    serial: int = -1  # unique within the engine (object ids are reused after garbage collection)
    # The event loop ``emit`` runs on: a step's tokens for every sequence of one loop reach it in
    # one wake-up, not one per sequence.
    loop: asyncio.AbstractEventLoop | None = None
    # Gives the pulled KV's memory back once it is copied (a KV lent by a prefill of this host).
    release_kv: Callable[[], None] = field(default=lambda: None, repr=False)
    deadline: float | None = None  # time.monotonic(); None: none
    bypassed: int = 0  # admissions of later requests while this one, first in line, did not fit
    grammar: GrammarState | None = None  # the structured output's state after the tokens so far
    # The request's logits processors (penalties, min_tokens, ...); None: the fast path.
    processor: LogitsProcessor | None = field(default=None, repr=False)
    # The prefix-cache blocks its KV's first positions came from (shared in the pool when held).
    prefix_blocks: PrefixBlocks = field(default_factory=PrefixBlocks)

    def cancel(self) -> None:
        self.cancelled.set()

    def drop_kv(self) -> None:
        """The pulled KV is no longer needed (copied into the pool, or the request ended first)."""
        self.kv = ()
        release, self.release_kv = self.release_kv, lambda: None
        release()

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.kv[0][0].shape[1]) if self.kv else self.num_cached

    def max_cached_tokens(self) -> int:
        """Positions this request may ever write: the prompt, then every token but the last (the
        tokens generated so far have their positions counted already, or come as their next input)."""
        return self.num_prompt_tokens + self.params.max_tokens - self.num_generated

    def append_token(self, token_id: int) -> None:
        """A step ran this sequence: its input position is cached and ``token_id`` is its next input."""
        self.num_cached += 1
        self.num_generated += 1
        self.last_token_id = token_id
        if self.grammar is not None:
            self.grammar.advance(token_id)


@dataclass(frozen=True)
class Emission:
    """What one step (or admission, or a failure) tells one request; the last one has a reason or an error."""

    sequence: DecodeSequence
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: BaseException | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token when the request asks for logprobs

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.error is not None


def deliver(emissions: Sequence[Emission]) -> None:
    """Runs each emission on its sequence's loop (one wake-up per loop) or here when it has none."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Emission]] = {}
    for emission in emissions:
        loop = emission.sequence.loop
        if loop is None:
            emission.sequence.emit(emission)
        else:
            by_loop.setdefault(loop, []).append(emission)
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_emit_all, batch)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            logger.debug("dropped %d emissions for a closed event loop", len(batch))


def _emit_all(batch: Sequence[Emission]) -> None:
    for emission in batch:
        emission.sequence.emit(emission)
