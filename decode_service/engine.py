"""The decode engine: continuous batching over a paged KV pool, on its own thread.

Lifecycle of a request here:
1. the servicer submits it with the KV pulled from the prefill (transfers run elsewhere, so a
   step never waits for another request's transfer);
2. it waits until the running set has room (``max_running``) and the pool can reserve every
   block it may need (prompt + max_tokens - 1 positions); a full pool makes it wait, not fail;
3. admitted at the start of a step, its KV is copied into its own blocks (nothing else moves)
   and it joins the running set;
4. every step runs all running requests in one forward: each row feeds its last token at its own
   position, attends to its own context through the step cache, and samples at its own step;
5. each new token is handed to the servicer's stream at once; a request leaves the running set
   (and frees its blocks) the step it finishes, or the step after it is cancelled.

``warm_up`` (``--compile``, before the service is ready) runs real steps, on the engine thread, of
dummy sequences of zero KV: one row, then rows of different lengths, a few steps each, so that
every shape class of a step is compiled. Their blocks are freed when they end, and their steps
are not counted in the step and token metrics.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decode_service.kv_pool import KvPool
from decode_service.metrics import DecodeMetrics
from decode_service.step_cache import BatchContext, StepCache, StepLayer
from pdserve.core.finish import finish_reason
from pdserve.core.sampling import SamplingParams, sample
from pdserve.model.engine_model import EngineModel
from pdserve.model.warm_up import WarmUp

logger = logging.getLogger(__name__)

# Called with (new token ids, finish reason or None, error or None): on the sequence's event loop
# when it names one, else on the engine thread.
EmitFn = Callable[[list[int], str | None, BaseException | None], None]
# One sequence's news of a step: (sequence, new token ids, finish reason, error).
_Emission = tuple["DecodeSequence", list[int], str | None, BaseException | None]
# The prompt lengths of the sequences of each warm-up batch, and how many steps each batch runs.
WARM_UP_BATCHES: tuple[tuple[int, ...], ...] = ((7,), (9, 4), (6, 13, 3))
WARM_UP_STEPS = 3


@dataclass
class DecodeSequence:
    request_id: str
    kv: Sequence[tuple[torch.Tensor, torch.Tensor]]
    first_token_id: int
    params: SamplingParams
    emit: EmitFn
    cancelled: threading.Event = field(default_factory=threading.Event)
    num_generated: int = 1
    last_token_id: int = -1
    num_cached: int = 0  # positions whose KV is in the pool
    blocks: list[int] = field(default_factory=list)
    serial: int = -1  # unique within the engine (object ids are reused after garbage collection)
    # The event loop ``emit`` runs on: a step's tokens for every sequence of one loop reach it in
    # one wake-up, not one per sequence.
    loop: asyncio.AbstractEventLoop | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.kv[0][0].shape[1]) if self.kv else self.num_cached

    def max_cached_tokens(self) -> int:
        """Positions this request may ever write: the prompt, then every token but the last."""
        return self.num_prompt_tokens + self.params.max_tokens - 1


class DecodeEngine:
    def __init__(
        self, engine_model: EngineModel, metrics: DecodeMetrics, max_running: int, pool: KvPool
    ) -> None:
        self._m = engine_model
        self._metrics = metrics
        self._max_running = max_running
        self._pool = pool
        self._context = BatchContext(pool, max_running)
        self._serials = itertools.count()
        self._inbox: queue.SimpleQueue[DecodeSequence | WarmUp | None] = queue.SimpleQueue()
        self._waiting: collections.deque[DecodeSequence] = collections.deque()
        self._warm_ups: collections.deque[WarmUp] = collections.deque()
        self._running: list[DecodeSequence] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        self._mask_value = torch.finfo(engine_model.kv_layout.dtype).min
        metrics.running.set_function(lambda: len(self._running))
        metrics.waiting.set_function(lambda: len(self._waiting) + self._inbox.qsize())
        metrics.kv_blocks_used.set_function(lambda: pool.num_used_blocks)

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
            "decode warm-up: %s batches of %s steps in %.2f s", len(WARM_UP_BATCHES), WARM_UP_STEPS, seconds
        )
        return seconds

    @property
    def num_running(self) -> int:
        return len(self._running)

    def fits_ever(self, num_tokens: int) -> bool:
        return self._pool.blocks_for(num_tokens) <= self._pool.num_blocks

    def submit(self, seq: DecodeSequence) -> None:
        seq.last_token_id = seq.first_token_id
        seq.serial = next(self._serials)
        self._inbox.put(seq)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self._m.device.type == "cuda":
            torch.cuda.set_device(self._m.device)
        while not self._stopped.is_set():
            self._receive(block=not self._running and not self._waiting)
            while self._warm_ups:
                self._warm_ups.popleft().run(self._warm_up)
            self._admit()
            self._drop_cancelled()
            if not self._running:
                self._context.clear()
                continue
            try:
                started = time.perf_counter()
                rows = len(self._running)
                self._step()
                elapsed = time.perf_counter() - started
                self._metrics.step_seconds.observe(elapsed)
                self._metrics.row_step_seconds.inc(elapsed * rows)
            except Exception as exc:
                logger.exception("decode step failed; failing its %d requests", len(self._running))
                for seq in self._running:
                    self._finish(seq, None, exc)
                self._running.clear()
        self._receive(block=False)
        for seq in [*self._running, *self._waiting]:
            _deliver([(seq, [], None, RuntimeError("decode engine stopped"))])
        for request in self._warm_ups:
            request.abandon("the decode engine stopped")

    def _receive(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return
        while item is not None:
            if isinstance(item, WarmUp):
                self._warm_ups.append(item)
            else:
                self._waiting.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self._max_running:
            seq = self._waiting[0]
            if seq.cancelled.is_set():
                self._waiting.popleft()
                continue
            reason = finish_reason(seq.first_token_id, 1, seq.params, self._m.limits.eos_token_ids)
            if reason is not None:
                self._waiting.popleft()
                _deliver([(seq, [], reason, None)])
                continue
            if not self._pool.can_allocate(seq.max_cached_tokens()):
                return  # first come, first served: wait until running requests free blocks
            self._waiting.popleft()
            seq.blocks = self._pool.allocate(seq.max_cached_tokens())
            seq.num_cached = self._pool.write(seq.blocks, seq.kv)
            seq.kv = ()
            self._running.append(seq)

    def _warm_up(self) -> None:
        running = self._running
        try:
            for lengths in WARM_UP_BATCHES:
                rows = [self._warm_up_sequence(i, n) for i, n in enumerate(lengths)]
                needed = sum(self._pool.blocks_for(seq.max_cached_tokens()) for seq in rows)
                if needed > self._pool.num_free_blocks:
                    logger.warning(
                        "decode warm-up skips %s rows: they need %s KV blocks, %s are free",
                        len(rows),
                        needed,
                        self._pool.num_free_blocks,
                    )
                    continue
                for seq in rows:
                    seq.blocks = self._pool.allocate(seq.max_cached_tokens())
                    seq.num_cached = self._pool.write(seq.blocks, seq.kv)
                    seq.kv = ()
                self._running = rows
                while self._running:  # every row ends (and frees its blocks) at its last step
                    self._step(counted=False)
        finally:
            for seq in self._running:
                self._pool.free(seq.blocks)
                seq.blocks = []
            self._running = running
            self._context.clear()

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
        seq = DecodeSequence(f"warm-up-{row}", kv, row % self._m.limits.vocab_size, params, _ignore)
        seq.last_token_id = seq.first_token_id
        seq.serial = next(self._serials)
        return seq

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._running if s.cancelled.is_set()]:
            self._running.remove(seq)
            self._pool.free(seq.blocks)
            seq.blocks = []

    def _step(self, counted: bool = True) -> None:
        """One forward of the running rows; ``counted``: in the step and token metrics."""
        device = self._m.device
        pool = self._pool
        order = self._context.sync(
            [s.serial for s in self._running],
            [s.blocks for s in self._running],
            [s.num_cached for s in self._running],
        )
        rows = self._running = [self._running[i] for i in order]
        lengths = torch.tensor([s.num_cached for s in rows], dtype=torch.long)
        length = int(lengths.max()) + 1
        write = torch.tensor(
            [
                s.blocks[s.num_cached // pool.block_size] * pool.block_size + s.num_cached % pool.block_size
                for s in rows
            ],
            dtype=torch.long,
        )
        valid = torch.arange(length)[None, :] <= lengths[:, None]
        mask = torch.zeros((len(rows), 1, 1, length), dtype=pool.layout.dtype)
        mask.masked_fill_(~valid[:, None, None, :], self._mask_value)
        write_d, lengths_d = write.to(device), lengths.to(device)
        cache = StepCache(
            [
                StepLayer(
                    pool.keys[i],
                    pool.values[i],
                    self._context.keys[i][: len(rows)],
                    self._context.values[i][: len(rows)],
                    write_d,
                    lengths_d,
                    length,
                )
                for i in range(pool.layout.num_layers)
            ]
        )
        input_ids = torch.tensor([[s.last_token_id] for s in rows], dtype=torch.long, device=device)
        out = self._m.forward(
            input_ids=input_ids,
            position_ids=lengths_d[:, None],
            attention_mask=mask.to(device),
            cache=cache,
            use_cache=True,
        )
        logits = out.logits[:, -1]
        tokens = self._sample(logits, rows)
        if counted:
            self._metrics.steps.inc()
            self._metrics.generated_tokens.inc(len(rows))
        finished = []
        emissions: list[_Emission] = []
        for seq, token in zip(rows, tokens, strict=True):
            seq.num_cached += 1
            seq.num_generated += 1
            seq.last_token_id = token
            reason = finish_reason(token, seq.num_generated, seq.params, self._m.limits.eos_token_ids)
            emissions.append((seq, [token], reason, None))
            if reason is not None:
                finished.append(seq)
        _deliver(emissions)
        for seq in finished:
            self._running.remove(seq)
            self._pool.free(seq.blocks)
            seq.blocks = []

    def _sample(self, logits: torch.Tensor, rows: Sequence[DecodeSequence]) -> list[int]:
        greedy = logits.max(dim=-1).indices.tolist()  # the first maximum, as argmax; faster on CPU
        return [
            int(greedy[i]) if seq.params.is_greedy else sample(logits[i], seq.params, step=seq.num_generated)
            for i, seq in enumerate(rows)
        ]

    def _finish(self, seq: DecodeSequence, reason: str | None, error: BaseException | None) -> None:
        self._pool.free(seq.blocks)
        seq.blocks = []
        _deliver([(seq, [], reason, error)])


def _ignore(tokens: list[int], reason: str | None, error: BaseException | None) -> None:
    return None


def _deliver(emissions: Sequence[_Emission]) -> None:
    """Runs each emission on its sequence's loop (one wake-up per loop) or here when it has none."""
    by_loop: dict[asyncio.AbstractEventLoop, list[_Emission]] = {}
    for emission in emissions:
        loop = emission[0].loop
        if loop is None:
            _run(emission)
        else:
            by_loop.setdefault(loop, []).append(emission)
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_run_all, batch)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            logger.debug("dropped %d emissions for a closed event loop", len(batch))


def _run_all(batch: Sequence[_Emission]) -> None:
    for emission in batch:
        _run(emission)


def _run(emission: _Emission) -> None:
    seq, tokens, reason, error = emission
    seq.emit(tokens, reason, error)
