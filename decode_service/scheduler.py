"""Which requests a decode step runs, and what becomes of them after it.

Lifecycle of a request in the scheduler:
1. ``add``: it waits, first come first served;
2. ``schedule`` admits it once the running set has room (``max_running``) and the pool can reserve
   every block it may need (prompt + max_tokens - 1 positions): its leading prompt blocks that the
   pool holds already are shared (``KvPool.admit``), the rest of its KV is copied into blocks of its
   own, and it joins the running set. A full pool makes it wait, not fail; one complete at its
   first token is answered there without running; a cancelled one is dropped; one whose deadline
   passed ends with ``DeadlineExpired``. When the first in line does not fit the pool, later ones
   that fit are admitted past it (a short request is not stuck behind a long one), but only
   ``max_bypass`` times (0: never, strictly first come first served): then the line waits for it,
   so that the pool drains for the long one;
3. ``absorb`` takes a step's sampled token of each running request, hands it to the request at
   once and ends the request when ``finish_reason`` says so;
4. it leaves the running set, freeing its blocks (``_leave``, the only place that frees them), the
   step it finishes, the step after it is cancelled or its deadline passed, or when it fails
   (``fail``, ``abandon``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Collection, Sequence

from decode_service.kv_pool import BlockKey, KvPool
from decode_service.runner import StepOutput
from decode_service.sequence import DeadlineExpired, DecodeSequence, Emission, deliver
from pdserve.core.finish import finish_reason


class Scheduler:
    def __init__(
        self, pool: KvPool, max_running: int, eos_token_ids: Collection[int], max_bypass: int = 0
    ) -> None:
        if max_running < 1:
            raise ValueError(f"a scheduler needs room to run, got max_running={max_running}")
        self._pool = pool
        self._max_running = max_running
        self._eos_token_ids = eos_token_ids
        self._max_bypass = max_bypass
        self.waiting: collections.deque[DecodeSequence] = collections.deque()
        self.running: list[DecodeSequence] = []
        self.num_bypassed = 0  # admissions past a first in line that did not fit
        self.num_expired = 0  # requests ended because their deadline passed

    @property
    def is_idle(self) -> bool:
        return not self.running and not self.waiting

    def add(self, seq: DecodeSequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[DecodeSequence]:
        """Admits the waiting requests that fit and drops the cancelled running ones; returns the
        rows of the next step (none: nothing to run)."""
        now = time.monotonic()
        self._admit(now)
        for seq in [s for s in self.running if s.cancelled.is_set()]:
            self._leave(seq)
        expired = [s for s in self.running if s.expired(now)]
        for seq in expired:
            self._leave(seq)
        self._expire(expired)
        return list(self.running)

    def absorb(self, output: StepOutput) -> None:
        """Hands each row its token from the step; the rows that finished leave."""
        self.running = list(output.rows)  # in the order the step ran them, as the batch context holds them
        emissions = []
        for i, (seq, token_id) in enumerate(zip(output.rows, output.token_ids, strict=True)):
            seq.append_token(token_id)
            reason = finish_reason(token_id, seq.num_generated, seq.params, self._eos_token_ids)
            entry = output.logprobs[i] if output.logprobs else None
            if seq.grammar is not None:
                reason = seq.grammar.finish_reason(reason)
            emissions.append(Emission(seq, (token_id,), reason, logprobs=(entry,) if entry else ()))
            if reason is not None:
                self._leave(seq)
        deliver(emissions)

    def fail(self, error: BaseException) -> None:
        """Ends every running request with ``error`` (their step failed)."""
        running = list(self.running)
        for seq in running:
            self._leave(seq)
        deliver([Emission(seq, error=error) for seq in running])

    def abandon(self, error: BaseException) -> None:
        """Ends every request held, running or waiting, with ``error``."""
        held = [*self.running, *self.waiting]
        for seq in list(self.running):
            self._leave(seq)
        for seq in self.waiting:
            seq.drop_kv()
        self.waiting.clear()
        deliver([Emission(seq, error=error) for seq in held])

    def _admit(self, now: float) -> None:
        self._drop_ended(now)
        head: DecodeSequence | None = None  # the first in line, when it does not fit
        kept: collections.deque[DecodeSequence] = collections.deque()
        while self.waiting and len(self.running) < self._max_running:
            seq = self.waiting.popleft()
            keys = seq.prefix_blocks.keys(self._pool.block_size)
            if self._pool.can_allocate(seq.max_cached_tokens(), keys):
                self._join(seq, keys)
                if head is not None:
                    head.bypassed += 1
                    self.num_bypassed += 1
                continue
            kept.append(seq)
            if head is None:
                head = seq
            if head.bypassed >= self._max_bypass:
                break  # no more requests past it: the pool drains until it fits
        kept.extend(self.waiting)
        self.waiting = kept

    def _drop_ended(self, now: float) -> None:
        """Drops the waiting requests that are cancelled, expired, or complete at their first token."""
        if not self.waiting:
            return
        left: collections.deque[DecodeSequence] = collections.deque()
        expired: list[DecodeSequence] = []
        finished: list[Emission] = []
        for seq in self.waiting:
            if seq.cancelled.is_set():
                seq.drop_kv()
            elif seq.expired(now):
                seq.drop_kv()
                expired.append(seq)
            elif (
                reason := finish_reason(
                    seq.first_token_id, seq.num_generated, seq.params, self._eos_token_ids
                )
            ) is not None:
                seq.drop_kv()
                finished.append(Emission(seq, finish_reason=reason))
            else:
                left.append(seq)
        self.waiting = left
        deliver(finished)
        self._expire(expired)

    def _expire(self, expired: list[DecodeSequence]) -> None:
        if expired:
            self.num_expired += len(expired)
            deliver([Emission(seq, error=DeadlineExpired()) for seq in expired])

    def _join(self, seq: DecodeSequence, keys: Sequence[BlockKey]) -> None:
        """Reserves every block ``seq`` may need (sharing the prompt blocks under ``keys`` the pool
        holds already) and copies the rest of its received KV into them."""
        seq.blocks, shared = self._pool.admit(seq.max_cached_tokens(), keys)
        seq.num_cached = self._pool.write(seq.blocks, seq.kv, start=shared)
        seq.drop_kv()
        self.running.append(seq)

    def _leave(self, seq: DecodeSequence) -> None:
        self.running.remove(seq)
        self._pool.free(seq.blocks)
        seq.blocks = []
