"""The decode engine: continuous batching over a paged KV pool, on its own thread.

Lifecycle of a request here:
1. the servicer submits it with the KV pulled from the prefill (transfers run elsewhere, so a
   step never waits for another request's transfer); it reaches the engine thread's inbox;
2. the scheduler (``scheduler``) admits it when it has room and the pool can reserve its blocks;
3. every step, the scheduler picks the running rows, the runner (``runner``) runs them in one
   forward and samples a token for each, and the scheduler absorbs the tokens: each goes to its
   request's stream at once, and a finished request leaves and frees its blocks;
4. a failed step ends every request it ran with the error; a stopped engine ends every request.
At start-up the runner's batch context is allocated for ``max_running`` rows of
``RESERVED_POSITIONS`` (at most a ``RESERVED_POOL_SHARE``-th of the KV pool's tokens), so that a
burst within it does not stall on fresh memory (``step_cache``). Once nothing has run for
``context_idle_s``, the batch context is freed down to that reservation (a burst's memory goes back;
the next step beyond it allocates anew).

``warm_up`` (``--compile``, before the service is ready) runs real steps, on the engine thread, of
dummy sequences of zero KV through a scheduler of their own over the same pool and runner: one
row, then rows of different lengths (with one or two long ones, when steps may split rows by
length), a few steps each, so that every shape class of a step is compiled. Their blocks are freed
when they end, and their steps are not counted in the metrics.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time

import torch

from decode_service.kv_pool import KvPool
from decode_service.metrics import DecodeMetrics
from decode_service.runner import StepRunner
from decode_service.scheduler import Scheduler
from decode_service.sequence import DecodeSequence, Emission
from pdserve.core.sampling import SamplingParams
from pdserve.model.engine_model import EngineModel
from pdserve.model.ragged_attention import split_rows
from pdserve.model.warm_up import WarmUp

logger = logging.getLogger(__name__)

# The prompt lengths of the sequences of each warm-up batch, and how many steps each batch runs.
# The last two's rows share a prefix (their KV is all zeros): their steps attend to it once, one row
# then two.
WARM_UP_BATCHES: tuple[tuple[int, ...], ...] = ((7,), (9, 4), (6, 13, 3), (21,), (20, 18))
WARM_UP_STEPS = 3
# When steps may split rows by length (``ragged``), batches of short rows with one long row, then two,
# whose steps split; the long rows' lengths at most (within the model's context length). The first
# batch's short rows attend over 9 positions and more, never the long tier's 8 first allocated rows
# (``MIN_ROWS``): sizes equal at a compilation are one size to its code, which the next step, where
# they differ, would compile again.
RAGGED_WARM_UP: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = (
    ((2, 3, 4, 5, 6, 8), (600,)),
    ((2, 3, 4, 5, 6, 7, 3, 4, 5, 6), (600, 590)),
)
# The batch context allocated at start-up: rows of this many positions, one per request the engine
# may run, but at most a RESERVED_POOL_SHARE-th of the KV pool's tokens in all.
RESERVED_POSITIONS = 256
RESERVED_POOL_SHARE = 4


class DecodeEngine:
    def __init__(
        self,
        engine_model: EngineModel,
        metrics: DecodeMetrics,
        max_running: int,
        pool: KvPool,
        max_bypass: int = 0,
        context_idle_s: float = 10.0,
        shared_prefix: bool = False,
        ragged: bool = False,
    ) -> None:
        """``shared_prefix``, ``ragged``: the model runs ``shared_prefix_attention`` (see ``StepRunner``)."""
        self._m = engine_model
        self._metrics = metrics
        self._pool = pool
        self._runner = StepRunner(engine_model, pool, max_running, shared_prefix, ragged)
        self._ragged = ragged
        pool_tokens = pool.num_blocks * pool.block_size
        reserved_rows = min(max_running, pool_tokens // (RESERVED_POOL_SHARE * RESERVED_POSITIONS))
        if reserved_rows:
            self._runner.reserve(reserved_rows, RESERVED_POSITIONS)
        self._scheduler = Scheduler(pool, max_running, engine_model.limits.eos_token_ids, max_bypass)
        self._context_idle_s = context_idle_s
        self._idle_since: float | None = None
        # The scheduler's bypassed and expired counts and the pool's shared tokens already in the metrics.
        self._counted = (0, 0, 0)
        self._serials = itertools.count()
        self._inbox: queue.SimpleQueue[DecodeSequence | WarmUp | None] = queue.SimpleQueue()
        self._warm_ups: collections.deque[WarmUp] = collections.deque()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        metrics.running.set_function(lambda: len(self._scheduler.running))
        metrics.waiting.set_function(lambda: len(self._scheduler.waiting) + self._inbox.qsize())
        metrics.kv_blocks_used.set_function(lambda: pool.num_used_blocks)
        metrics.kv_blocks_idle.set_function(lambda: pool.num_idle_blocks)
        metrics.batch_context_bytes.set_function(lambda: self._runner.context_bytes)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def warm_up(self) -> float:
        """Runs the steps of ``WARM_UP_BATCHES`` on the engine thread (after ``start``); blocks until
        done and returns its duration in seconds. The pool is as it was before, once it returns."""
        request = WarmUp()
        self._inbox.put(request)
        seconds = request.wait()
        logger.info(
            "decode warm-up: %s batches of %s steps in %.2f s",
            len(self._warm_up_batches()),
            WARM_UP_STEPS,
            seconds,
        )
        return seconds

    @property
    def num_running(self) -> int:
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests submitted (their KV pulled) and not yet running."""
        return len(self._scheduler.waiting) + self._inbox.qsize()

    def fits_ever(self, num_tokens: int) -> bool:
        return self._pool.blocks_for(num_tokens) <= self._pool.num_blocks

    def submit(self, seq: DecodeSequence) -> None:
        self._inbox.put(self._numbered(seq))

    def _numbered(self, seq: DecodeSequence) -> DecodeSequence:
        """``seq`` with its serial, and its first token as its next input."""
        seq.last_token_id = seq.first_token_id
        seq.serial = next(self._serials)
        return seq

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self._m.device.type == "cuda":
            torch.cuda.set_device(self._m.device)
        while not self._stopped.is_set():
            self._receive(block=self._scheduler.is_idle)
            while self._warm_ups:
                self._warm_ups.popleft().run(self._warm_up)
            rows = self._scheduler.schedule()
            self._count_scheduling()
            if rows:
                self._idle_since = None
                self._timed_step(rows)
            else:
                self._runner.clear()
                self._release_when_idle()
        self._receive(block=False)
        self._scheduler.abandon(RuntimeError("decode engine stopped"))
        for request in self._warm_ups:
            request.abandon("the decode engine stopped")

    def _count_scheduling(self) -> None:
        bypassed, expired = self._scheduler.num_bypassed, self._scheduler.num_expired
        shared = self._pool.num_shared_tokens
        self._metrics.bypassed.inc(bypassed - self._counted[0])
        self._metrics.deadline_expired.inc(expired - self._counted[1])
        self._metrics.kv_shared_tokens.inc(shared - self._counted[2])
        self._counted = (bypassed, expired, shared)

    def _release_when_idle(self) -> None:
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since >= self._context_idle_s and self._runner.context_bytes:
            self._runner.release()
            logger.debug("decode idle for %.1f s: batch context freed", now - self._idle_since)

    def _receive(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while item is not None:
            if isinstance(item, WarmUp):
                self._warm_ups.append(item)
            else:
                self._scheduler.add(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _timed_step(self, rows: list[DecodeSequence]) -> None:
        """``_step`` in the step metrics; a step that fails ends its requests with its error."""
        started = time.perf_counter()
        try:
            self._step(rows)
        except Exception as exc:
            logger.exception("decode step failed; failing its %d requests", len(rows))
            self._scheduler.fail(exc)
            return
        elapsed = time.perf_counter() - started
        self._metrics.step_seconds.observe(elapsed)
        self._metrics.row_step_seconds.inc(elapsed * len(rows))

    def _step(self, rows: list[DecodeSequence]) -> None:
        output = self._runner.run(rows)
        self._metrics.steps.inc()
        self._metrics.generated_tokens.inc(len(output.rows))
        if output.shared_prefix_tokens:
            self._metrics.shared_prefix_steps.inc()
        if output.long_rows:
            self._metrics.ragged_steps.inc()
        self._scheduler.absorb(output)

    def _warm_up(self) -> None:
        try:
            for lengths in self._warm_up_batches():
                self._warm_up_batch([self._warm_up_sequence(i, n) for i, n in enumerate(lengths)])
        finally:
            self._runner.clear()

    def _warm_up_batches(self) -> list[tuple[int, ...]]:
        """The prompt lengths of each warm-up batch: ``WARM_UP_BATCHES``, and ``RAGGED_WARM_UP``'s
        batches that split as meant (their long rows' lengths cut to the model's context length)."""
        batches = list(WARM_UP_BATCHES)
        if not self._ragged:
            return batches
        room = self._m.limits.max_model_len - WARM_UP_STEPS - 1
        for short, long in RAGGED_WARM_UP:
            lengths = (*short, *(min(n, room - i) for i, n in enumerate(long)))
            split = split_rows([n + 1 for n in lengths])
            if split is not None and len(split[1]) == len(long):
                batches.append(lengths)
        return batches

    def _warm_up_batch(self, rows: list[DecodeSequence]) -> None:
        """Runs ``rows`` until they end (after ``WARM_UP_STEPS``), uncounted, when they fit the pool."""
        needed = sum(self._pool.blocks_for(seq.max_cached_tokens()) for seq in rows)
        if needed > self._pool.num_free_blocks:
            logger.warning(
                "decode warm-up skips %s rows: they need %s KV blocks, %s are free",
                len(rows),
                needed,
                self._pool.num_free_blocks,
            )
            return
        scheduler = Scheduler(self._pool, len(rows), self._m.limits.eos_token_ids)
        for seq in rows:
            scheduler.add(seq)
        try:
            while batch := scheduler.schedule():  # every row ends (and frees its blocks) at its last step
                scheduler.absorb(self._runner.run(batch))
        finally:
            scheduler.abandon(RuntimeError("decode warm-up ended"))

    def _warm_up_sequence(self, row: int, num_tokens: int) -> DecodeSequence:
        """A greedy sequence of ``num_tokens`` zero KV positions that ends after ``WARM_UP_STEPS``."""
        layout = self._m.kv_layout
        device = self._m.device
        kv = [
            (
                torch.zeros((key_heads, num_tokens, key_width), dtype=layout.dtype, device=device),
                torch.zeros((value_heads, num_tokens, value_width), dtype=layout.dtype, device=device),
            )
            for (key_heads, key_width), (value_heads, value_width) in zip(
                layout.keys, layout.values, strict=True
            )
        ]
        params = SamplingParams(max_tokens=WARM_UP_STEPS + 1, temperature=0.0, ignore_eos=True)
        return self._numbered(
            DecodeSequence(f"warm-up-{row}", kv, row % self._m.limits.vocab_size, params, _ignore)
        )


def _ignore(emission: Emission) -> None:
    return None
