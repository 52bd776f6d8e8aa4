"""The prefill engine: prompt forwards in chunks of a token budget, each first token sampled from its row.

Lifecycle of a request here:
1. the servicer validates it and submits it; it waits in the engine's queue, then in its line;
2. at each step the engine begins the prompts at the head of the line (a prompt whose deadline
   passed is dropped then, ``DeadlineExpired``): each takes the longest prefix of full blocks the
   prefix cache holds (``prefix_cache``; never its last token), so only the rest of it runs;
3. the step takes chunks of the prompts in line order within the token budget (``chunk_schedule``:
   rows times the longest chunk of each forward, left-padded; a prompt longer than the budget is cut
   into chunks of it and goes to the back of the line after each, so prompts behind it run
   between its chunks) and runs one forward per group of rows with KV of one length
   (``prompt_forward``: fresh for whole prompts without a cache hit, ``logits_to_keep=1``: every
   row's last position is its chunk's last token), a group split into forwards of the size that
   the line's tokens call for (``forward_size``); after each forward the full blocks of its
   prompts are offered to the prefix cache;
4. when its last chunk has run, a prompt's first token is sampled from that forward's logits at
   step 0, or, for a resumed request (its prompt ends with the ``num_generated`` tokens it had
   generated before its decode was lost), at step ``num_generated``, the finish rules counting
   those tokens;
5. a request complete at that token (max_tokens=1, EOS, a stop token or stop string) keeps
   nothing; otherwise its prompt's whole KV (cached prefix and computed tokens) is packed into one
   buffer of the prefill's KV space (its shared-memory arena, or private memory), ready to be parked
   under a handle;
6. it gets its result the moment that forward ends, with the time it waited before it began (step
   1 to 2) and the number of its tokens taken from the prefix cache.
With ``n`` > 1 choices, each samples its own first token from that row
(``prefill_service.first_choices``) and the KV is packed once, unless every choice is complete at
its first token. The logits processors (penalties, min_tokens, ...) and a structured output's
grammar mask apply to that row before sampling; a request that asks for logprobs gets its first
token's from the row's raw logits. One that asks for ``prompt_logprobs`` takes nothing from the
prefix cache and keeps the logits of every position of its chunks (``pdserve.core.logprobs``).
The servicer bounds the queue (``num_waiting``).

``num_waiting`` and ``num_running`` count the requests of step 1 and of steps 2-5.

``warm_up`` (``--compile``, before the service is ready) runs this same path on dummy prompts,
alone and batched with padding, then over a cached prefix, on the engine thread; its results are
dropped and the prefix cache is emptied of what it cached. ``calibrate`` (at start, after it)
times forwards of two sizes for the fixed cost that sizes forwards by the queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.core.grammar import GrammarState, apply_masks
from pdserve.core.logits_processing import request_processor
from pdserve.core.logprobs import TokenLogprobs, position_logprobs, prompt_logprobs
from pdserve.core.sampling import SamplingParams
from pdserve.kv.layout import unpack
from pdserve.kv.transports import GLOO, Place
from pdserve.model.engine_model import EngineModel
from pdserve.model.warm_up import WarmUp
from prefill_service.chunk_schedule import Group, schedule, split
from prefill_service.first_choices import FirstToken, continues, first_tokens, with_grammar
from prefill_service.forward_size import ForwardSize, fixed_tokens, queued_tokens
from prefill_service.kv_space import KvSpace, ParkedBuffer
from prefill_service.prefix_cache import LayerKv, PrefixCache, reuse_problem
from prefill_service.prompt_forward import (
    ForwardOutput,
    ForwardScratch,
    KvParts,
    joined,
    pack_parts,
    run_forward,
)
from prefill_service.prompt_job import PromptJob

logger = logging.getLogger(__name__)


class DeadlineExpired(Exception):
    """The request's deadline passed before its forward."""


# The prompt lengths of each warm-up forward: one prompt, then batches, so that every shape class a
# request can bring is compiled once, with its sizes dynamic (a lone one-token prompt is a class of its
# own; batches of any size, padded or not, one token a row or more, are one class: ``run_forward``).
WARM_UP_BATCHES: tuple[tuple[int, ...], ...] = ((7,), (12,), (1,), (9, 5), (6, 14, 3), (1, 1), (4, 4))
# With a prefix cache, then: the lengths of the new tokens of prompts over a cached prefix of two
# blocks (the first one caches it), alone and batched with padding (with the shared-prefix attention,
# rows over one cached prefix); then rows over two different ones, and a prompt cut into chunks.
WARM_UP_CACHED: tuple[tuple[int, ...], ...] = ((3,), (5,), (1,), (2, 6), (4, 4))


# Forwards of each size timed to measure a forward's fixed cost (``PrefillEngine.calibrate``).
CALIBRATION_ROUNDS = 3


@dataclass(frozen=True)
class _Task:
    """Work the engine thread runs between its steps, once its line is empty (a warm-up)."""

    done: WarmUp
    work: Callable[[], None]


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    finish_reason: str | None
    kv: ParkedBuffer | None  # the packed KV, when the request goes on to decode
    num_tokens: int
    forward_seconds: float
    batch_size: int
    queue_seconds: float = 0.0
    choices: tuple[FirstToken, ...] = ()  # every choice's first token (the first is the fields above)
    logprobs: TokenLogprobs | None = None  # the first token's, when the request asks
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # prompt tokens 1..n-1, when the request asks
    choice_logprobs: tuple[TokenLogprobs, ...] = ()  # n > 1: each choice's first token's, when asked
    cached_tokens: int = 0  # of the prompt's, taken from the prefix cache
    # Ids of the prefix-cache blocks holding the KV of the prompt's first full blocks (``PromptJob``).
    block_ids: tuple[int, ...] = ()

    @property
    def kv_buffer(self) -> torch.Tensor | None:
        return self.kv.tensor if self.kv is not None else None


@dataclass
class _Pending:
    prompt_token_ids: list[int]
    params: SamplingParams
    num_generated: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[PrefillResult]
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    deadline: float | None = None  # time.monotonic()
    grammar: GrammarState | None = None  # the structured output's state, when the request has one


class PrefillEngine:
    def __init__(
        self,
        engine_model: EngineModel,
        kv_space: KvSpace | torch.device,
        max_batch_tokens: int = 8192,
        prefix_cache: PrefixCache | None = None,
        shared_prefix: bool = False,
        forward_size: ForwardSize | None = None,
    ) -> None:
        """``kv_space``: where KV is parked (a device: private memory there, moved over gloo).
        ``max_batch_tokens``: the token budget of a step. ``prefix_cache``: None, no prefix reuse.
        ``shared_prefix``: the model runs ``shared_prefix_attention`` (rows over one cached prefix
        attend to it once). ``forward_size``: most tokens of prompts one forward runs together,
        answered when it ends (``chunk_schedule.split``; None: the whole budget); one that follows
        the queue with its fixed cost unknown (0) has it measured by ``calibrate``."""
        self._m = engine_model
        if isinstance(kv_space, torch.device):
            kv_space = KvSpace(GLOO, Place("", str(kv_space)), kv_space)
        self._space = kv_space
        self._max_batch_tokens = max_batch_tokens
        self._forward = forward_size or ForwardSize(max_batch_tokens, max_batch_tokens)
        self._prefix = prefix_cache
        self._whole = reuse_problem(engine_model.model) is None  # forwards over PromptLayers
        self._scratch = ForwardScratch(engine_model.device)  # their memory, kept (engine thread only)
        self._shared_prefix = shared_prefix
        self.num_shared_prefix_forwards = 0  # forwards that read their rows' one cached prefix once
        self._queue: queue.SimpleQueue[_Pending | _Task | None] = queue.SimpleQueue()
        self._held: _Task | None = None
        self._line: list[PromptJob] = []  # admitted requests, in the order they are served
        self._closing = False
        self._num_waiting = 0
        self._num_running = 0
        self._count_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="prefill-engine", daemon=True)
        self._thread.start()

    async def run(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        num_generated: int = 0,
        deadline: float | None = None,
        grammar: GrammarState | None = None,
    ) -> PrefillResult:
        """``num_generated``: the last tokens of the prompt that the request generated before (a
        resumed request); its token is sampled at that step. ``deadline`` (``time.monotonic()``):
        raises DeadlineExpired when it passes before the forward. ``grammar``: the request's
        structured output after those tokens; its mask applies to the token sampled."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[PrefillResult] = loop.create_future()
        with self._count_lock:
            self._num_waiting += 1
        self._queue.put(
            _Pending(
                list(prompt_token_ids),
                params,
                num_generated,
                loop,
                future,
                deadline=deadline,
                grammar=grammar,
            )
        )
        try:
            return await future
        except asyncio.CancelledError:
            # Cancelled once its result was in: nothing will park the KV it holds.
            if future.done() and not future.cancelled() and future.exception() is None:
                kv = future.result().kv
                if kv is not None:
                    kv.free()
            raise

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet in a forward."""
        return self._num_waiting

    @property
    def num_running(self) -> int:
        """Requests whose forwards have begun and whose first token is not out yet."""
        return self._num_running

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self._prefix

    @property
    def forward_size(self) -> ForwardSize:
        return self._forward

    def warm_up(self) -> float:
        """Runs the prefill forwards of ``WARM_UP_BATCHES`` (and ``WARM_UP_CACHED`` with a prefix
        cache) on dummy prompts on the engine thread, as requests run; blocks until done and
        returns its duration in seconds."""
        seconds = self._run_task(self._warm_up)
        logger.info("prefill warm-up: %s forwards in %.2f s", len(WARM_UP_BATCHES), seconds)
        return seconds

    def calibrate(self) -> ForwardSize:
        """Where the forward size follows the queue and its fixed cost is not known yet: measures it
        on the engine thread (``forward_size.fixed_tokens``; blocks until done). Returns the size."""
        if self._forward.follows_queue and not self._forward.fixed_tokens:
            seconds = self._run_task(self._measure_fixed_tokens)
            logger.info(
                "prefill forwards of %d to %d tokens by the queue: fixed cost %.1f tokens (measured in %.2f s)",
                self._forward.least,
                self._forward.most,
                self._forward.fixed_tokens,
                seconds,
            )
        return self._forward

    def _run_task(self, work: Callable[[], None]) -> float:
        task = _Task(WarmUp(), work)
        self._queue.put(task)
        return task.done.wait()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, _Task):
                item.done.abandon("the prefill engine is closed")

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self._m.device.type == "cuda":
            torch.cuda.set_device(self._m.device)
        while True:
            self._admit()
            if self._closing and not self._line:
                return
            if not self._line and self._held is not None:
                task, self._held = self._held, None
                task.done.run(task.work)
                continue
            self._step(self._line)

    def _admit(self) -> None:
        """Moves what waits in the queue to the line (blocking while there is nothing to do); a
        warm-up waits until the line is empty, and nothing is admitted after it or after close."""
        while not self._closing and self._held is None:
            try:
                item = self._queue.get(block=not self._line)
            except queue.Empty:
                return
            if item is None:
                self._closing = True
                for job in self._line:  # a close ends the line too: nothing more runs
                    self._fail(job, RuntimeError("the prefill engine is closed"))
                self._line.clear()
            elif isinstance(item, _Task):
                self._held = item
            else:
                self._line.append(PromptJob(item.prompt_token_ids, item.params, item.num_generated, item))

    def _step(self, line: list[PromptJob]) -> None:
        """One step: begins the prompts it may reach, runs its forwards, answers the prompts done
        and sends the ones cut short to the back of ``line``."""
        self._begin(line)
        ready = []  # the head of the line that has begun
        for job in line:
            if not job.begun:
                break
            ready.append(job)
        if not ready:
            return
        most = self._forward_tokens(line)
        groups = [
            part
            for group in schedule([(job.done, job.remaining) for job in ready], self._max_batch_tokens)
            for part in split(group, most)
        ]
        cut: list[PromptJob] = []
        for group in groups:
            jobs = [ready[chunk.index] for chunk in group.chunks]
            try:
                finished = self._run_group(group, jobs)
            except Exception as exc:
                logger.exception("prefill forward of %d requests failed", len(jobs))
                self._flush_prefix()  # blocks offered before the failure: their KV is still intact
                for job in jobs:
                    self._fail(job, exc)
                    line.remove(job)
                continue
            for job in jobs:
                if job in finished:
                    line.remove(job)
                    self._answer(job, finished[job])
                else:
                    cut.append(job)
            # The copies into the prefix cache, once the group's first tokens are on their way and
            # before anything else can take the memory they read (the next forward's packing).
            self._flush_prefix()
        for job in cut:
            line.remove(job)
            line.append(job)

    def _forward_tokens(self, line: list[PromptJob]) -> int:
        """Most tokens of the step's forwards, for the tokens ``line`` has to run."""
        if not self._forward.follows_queue:
            return self._forward.least
        begun = [(len(job.token_ids), job.cached_tokens, job.remaining) for job in line if job.begun]
        not_begun = [len(job.token_ids) for job in line if not job.begun]
        return self._forward.tokens_for(queued_tokens(begun, not_begun))

    def _begin(self, line: list[PromptJob]) -> None:
        """Begins prompts at the head of ``line`` until their tokens to run fill the budget: each
        takes its cached prefix now, as late as can be; expired or cancelled ones leave the line."""
        need = 0
        for job in list(line):
            if need >= self._max_batch_tokens:
                return
            if not job.begun:
                pending = job.request
                if pending is not None:
                    with self._count_lock:
                        self._num_waiting -= 1
                    if pending.future.cancelled() or _expired(pending):
                        line.remove(job)
                        continue
                    with self._count_lock:
                        self._num_running += 1
                job.begin(self._prefix, time.perf_counter())
            need += job.remaining

    def _run_group(self, group: Group, jobs: list[PromptJob]) -> dict[PromptJob, PrefillResult]:
        """One forward of the group's chunks; the results of the prompts it ends."""
        m = self._m
        start = time.perf_counter()
        chunks = [job.next_chunk(c.num_tokens) for job, c in zip(jobs, group.chunks, strict=True)]
        pasts = [job.kv for job in jobs if job.kv is not None] if group.past else None
        keep = max([len(c) for job, c in zip(jobs, chunks, strict=True) if job.wants_prompt_logits] or [1])
        shared = self._shared_prefix and bool(group.past) and _one_cached_prefix(jobs)
        out = run_forward(m, pasts, chunks, keep, self._whole, self._scratch, shared)
        self.num_shared_prefix_forwards += shared
        finished: dict[PromptJob, PrefillResult] = {}
        for row, (job, chunk) in enumerate(zip(jobs, chunks, strict=True)):
            if job.wants_prompt_logits and out.kept is not None:
                job.prompt_logits.append(out.kept[row, -len(chunk) :])
            parts = out.row_parts(row)  # views, valid until the next forward
            new_blocks = job.ran(len(chunk), self._prefix)
            if job.remaining:  # its own copy: the forward's memory serves the next forward
                job.kv = kv = joined(parts)
            else:
                finished[job] = result = self._first_token(job, row, out, parts, len(jobs))
                if result.kv is not None:  # the same KV, contiguous: the cheaper copy
                    kv = unpack(result.kv.tensor, m.kv_layout, result.num_tokens)
                else:
                    kv = joined(parts) if new_blocks and self._prefix is not None else []
            self._offer_blocks(job, new_blocks, kv)
        if m.device.type == "cuda":
            torch.cuda.synchronize(m.device)
        elapsed = time.perf_counter() - start
        for job in jobs:
            job.forward_seconds += elapsed
        return {
            job: dataclasses.replace(
                result, forward_seconds=job.forward_seconds, block_ids=tuple(job.block_ids)
            )
            for job, result in finished.items()
        }

    def _flush_prefix(self) -> None:
        """Copies the blocks offered since the last flush into the prefix cache; one whose copy fails
        is left out of it (the requests it came from are answered, or failed, already)."""
        if self._prefix is None:
            return
        try:
            self._prefix.flush()
        except Exception:
            logger.exception("copying prompt blocks into the prefix cache failed: they are not cached")

    def _offer_blocks(self, job: PromptJob, blocks: list[tuple[bytes, int]], kv: LayerKv) -> None:
        """Offers the prefix cache ``job``'s new full blocks (hash, index; consecutive) from its KV
        ``kv``."""
        if self._prefix is None or not blocks:
            return
        size = self._prefix.block_size
        first = blocks[0][1]
        start, end = first * size, (blocks[-1][1] + 1) * size
        # The block before, when this prompt's own forward computed it: the new ones go right after.
        after = job.hashes[first - 1] if first > 0 and (first - 1) * size >= job.cached_tokens else None
        ids = self._prefix.insert(
            [h for h, _ in blocks], [(k[:, start:end], v[:, start:end]) for k, v in kv], after
        )
        job.cached(first, ids)

    def _first_token(
        self, job: PromptJob, row: int, out: ForwardOutput, parts: KvParts, batch_size: int
    ) -> PrefillResult:
        """The prompt's first token, sampled from the last logits row of its last forward, and its
        whole KV packed when the request goes on."""
        m = self._m
        row_params, step, num_tokens = job.params, job.num_generated, len(job.token_ids)
        raw = out.logits[row]
        row_logits = raw.clone()
        grammar = job.request.grammar if job.request is not None else None
        if grammar is not None:
            apply_masks(row_logits[None], [grammar])
        processor = request_processor(row_params, m.limits.eos_token_ids, job.token_ids, step)
        if processor is not None:
            row_logits = processor.apply(row_logits)
        choices = first_tokens(row_logits, row_params, step, m.limits.eos_token_ids, self._token_text)
        if grammar is not None:
            choices = with_grammar(choices, grammar)
        token, reason = choices[0].token_id, choices[0].finish_reason
        buffer = None
        if continues(choices):
            buffer = self._space.allocate(m.kv_layout.num_bytes(num_tokens))
            pack_parts(buffer.tensor, parts, m.kv_layout, num_tokens)
        result = PrefillResult(
            token,
            reason,
            buffer,
            num_tokens,
            0.0,
            batch_size,
            choices=choices,
            cached_tokens=job.cached_tokens,
        )
        if row_params.logprobs is not None or row_params.prompt_logprobs is not None:
            kept = torch.cat(job.prompt_logits) if job.prompt_logits else raw[None]
            result = _with_logprobs(result, kept, job.token_ids, row_params)
        return result

    def _answer(self, job: PromptJob, result: PrefillResult) -> None:
        pending = job.request
        if pending is None:
            return
        with self._count_lock:
            self._num_running -= 1
        queued = dataclasses.replace(result, queue_seconds=job.started - pending.submitted)
        pending.loop.call_soon_threadsafe(_set_result, pending.future, queued)

    def _fail(self, job: PromptJob, exc: BaseException) -> None:
        job.release(self._prefix)
        pending = job.request
        if pending is None:
            return
        with self._count_lock:
            if job.begun:
                self._num_running -= 1
            else:
                self._num_waiting -= 1
        pending.loop.call_soon_threadsafe(_set_exception, pending.future, exc)

    def _warm_up(self) -> None:
        vocab_size = self._m.limits.vocab_size
        params = SamplingParams(max_tokens=1, temperature=0.0)  # complete at the first token: no KV packed
        batches = [
            [[(row + i) % vocab_size for i in range(n)] for row, n in enumerate(lengths)]
            for lengths in WARM_UP_BATCHES
        ]
        if self._prefix is not None:
            prefix = [(3 * i + 1) % vocab_size for i in range(2 * self._prefix.block_size)]
            batches += [
                [prefix + [(row + i) % vocab_size for i in range(n)] for row, n in enumerate(lengths)]
                for lengths in WARM_UP_CACHED
            ]
            # Rows over two different cached prefixes of one length: each past is its own.
            other = [(5 * i + 2) % vocab_size for i in range(2 * self._prefix.block_size)]
            batches += [[[*other, 1, 2, 3]], [[*prefix, 4, 5], [*other, 6, 7, 8, 9, 10, 11]]]
        # A prompt longer than the budget: its second chunk runs over the first one's KV.
        batches.append([[(7 * i + 3) % vocab_size for i in range(self._max_batch_tokens + 3)]])
        for prompts in batches:
            line = [PromptJob(prompt, params, 0, None) for prompt in prompts]
            while line:
                self._step(line)
        if self._prefix is not None:
            self._prefix.clear()

    def _measure_fixed_tokens(self) -> None:
        """Times forwards of rows of one length, ``least`` tokens and up to ``most`` (the fastest of
        ``CALIBRATION_ROUNDS`` each, alternating), and keeps their fixed cost in tokens."""
        least, most = self._forward.least, self._forward.most
        row = max(1, min(least // 2, self._m.limits.max_model_len - 1))
        small = max(1, least // row)
        sizes = (small, max(small + 1, most // row))
        vocab_size = self._m.limits.vocab_size
        best = [math.inf, math.inf]
        for round_ in range(CALIBRATION_ROUNDS):
            for i, rows in enumerate(sizes):
                prompts = [[(97 * round_ + 31 * r + t) % vocab_size for t in range(row)] for r in range(rows)]
                started = time.perf_counter()
                run_forward(self._m, None, prompts, 1, self._whole, self._scratch)
                best[i] = min(best[i], time.perf_counter() - started)
        measured = fixed_tokens((sizes[0] * row, best[0]), (sizes[1] * row, best[1]), most)
        self._forward = dataclasses.replace(self._forward, fixed_tokens=measured)

    def _token_text(self, token: int) -> str:
        text: str = self._m.tokenizer.decode([token], skip_special_tokens=True)
        return text


def _with_logprobs(
    result: PrefillResult, logits: torch.Tensor, prompt: Sequence[int], params: SamplingParams
) -> PrefillResult:
    """``result`` with the logprobs its request asks for, from its row's kept logits ``[keep, vocab]``
    (the last position's predicts the first token)."""
    first = None
    per_choice: tuple[TokenLogprobs, ...] = ()
    if params.logprobs is not None:
        first = position_logprobs(logits[-1], result.first_token_id, params.logprobs)
        if len(result.choices) > 1:
            per_choice = tuple(
                position_logprobs(logits[-1], choice.token_id, params.logprobs) for choice in result.choices
            )
    in_prompt: tuple[TokenLogprobs, ...] = ()
    if params.prompt_logprobs is not None:
        in_prompt = tuple(prompt_logprobs(logits[-len(prompt) :], prompt, params.prompt_logprobs))
    return dataclasses.replace(result, logprobs=first, prompt_logprobs=in_prompt, choice_logprobs=per_choice)


def _one_cached_prefix(jobs: Sequence[PromptJob]) -> bool:
    """Whether every job's KV so far is the same cached prefix (the same blocks of the prefix cache,
    nothing run yet): the forward may read it once for all."""
    first = jobs[0].match
    if first is None or not first.blocks:
        return False
    slots = [block.slot for block in first.blocks]
    return all(
        job.match is not None
        and job.done == job.cached_tokens
        and [block.slot for block in job.match.blocks] == slots
        for job in jobs
    )


def _expired(pending: _Pending) -> bool:
    """Whether ``pending``'s deadline passed (it is then failed with DeadlineExpired)."""
    if pending.deadline is None or time.monotonic() < pending.deadline:
        return False
    pending.loop.call_soon_threadsafe(_set_exception, pending.future, DeadlineExpired())
    return True


def _set_result(future: asyncio.Future[PrefillResult], result: PrefillResult) -> None:
    if not future.done():
        future.set_result(result)
    elif result.kv is not None:  # its caller is gone (cancelled): nothing will park the KV
        result.kv.free()


def _set_exception(future: asyncio.Future[PrefillResult], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
