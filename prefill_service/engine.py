"""The prefill engine: batched prompt forwards, each request's first token sampled from its row.

Lifecycle of a request here:
1. the servicer validates it and submits it; it waits in the engine's queue;
2. the engine thread takes every waiting request that fits the token budget (batch size times
   the longest prompt, left-padded) and runs them in one forward with a fresh cache and
   ``logits_to_keep=1``: every row's last position is its prompt's last token;
3. each row's first token is sampled from that forward's logits at step 0, or, for a resumed
   request (its prompt ends with the ``num_generated`` tokens it had generated before its decode
   was lost), at step ``num_generated``, the finish rules counting those tokens;
4. a request complete at that token (max_tokens=1, EOS, a stop token or stop string) keeps
   nothing; otherwise its prompt's KV is packed into one buffer of the prefill's KV space (its
   shared-memory arena, or private memory), ready to be parked under a handle. With ``n`` > 1
   choices, each samples its own first token from that row (``prefill_service.first_choices``)
   and the KV is packed once, unless every choice is complete at its first token;
5. every request of the batch gets its result the moment that forward ends, with the time it
   waited in the queue (step 1 to 2).
A request that asks for logprobs gets its first token's from that forward's row; one that asks for
``prompt_logprobs`` runs in a forward of its own that keeps the logits of every position
(``logits_to_keep`` = its prompt's length, so no other row's positions are kept) and gets its
prompt's (``pdserve.core.logprobs``). A batch without either runs as before.
A request whose deadline passed while it waited is dropped before its forward (``DeadlineExpired``).
The servicer bounds the queue (``num_waiting``).

``num_waiting`` and ``num_running`` count the requests of steps 1 and 2-4.

``warm_up`` (``--compile``, before the service is ready) runs this same forward on dummy prompts,
alone and batched with padding, on the engine thread; its results are dropped and nothing is kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from pdserve.core.grammar import GrammarState, apply_masks
from pdserve.core.logits_processing import request_processor
from pdserve.core.logprobs import TokenLogprobs, position_logprobs, prompt_logprobs
from pdserve.core.sampling import SamplingParams
from pdserve.kv.layout import pack_into
from pdserve.kv.transports import GLOO, Place
from pdserve.model.engine_model import EngineModel
from pdserve.model.warm_up import WarmUp
from prefill_service.first_choices import FirstToken, continues, first_tokens, with_grammar
from prefill_service.kv_space import KvSpace, ParkedBuffer

logger = logging.getLogger(__name__)


class DeadlineExpired(Exception):
    """The request's deadline passed before its forward."""


# The prompt lengths of each warm-up forward: one prompt, then padded batches, so that every shape
# class a request can bring is compiled once, with its sizes dynamic (a size of 1 is a class of its
# own: one-token prompts).
WARM_UP_BATCHES: tuple[tuple[int, ...], ...] = ((7,), (12,), (1,), (9, 5), (6, 14, 3), (1, 1))


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
        self, engine_model: EngineModel, kv_space: KvSpace | torch.device, max_batch_tokens: int = 8192
    ) -> None:
        """``kv_space``: where KV is parked (a device: private memory there, moved over gloo)."""
        self._m = engine_model
        if isinstance(kv_space, torch.device):
            kv_space = KvSpace(GLOO, Place("", str(kv_space)), kv_space)
        self._space = kv_space
        self._max_batch_tokens = max_batch_tokens
        self._queue: queue.SimpleQueue[_Pending | WarmUp | None] = queue.SimpleQueue()
        self._held: _Pending | WarmUp | None = None
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
        return await future

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet in a forward."""
        return self._num_waiting

    @property
    def num_running(self) -> int:
        """Requests of the forward running now."""
        return self._num_running

    def warm_up(self) -> float:
        """Runs the prefill forward on the dummy prompts of ``WARM_UP_BATCHES`` on the engine thread,
        as requests run; blocks until done and returns its duration in seconds."""
        request = WarmUp()
        self._queue.put(request)
        seconds = request.wait()
        logger.info("prefill warm-up: %s forwards in %.2f s", len(WARM_UP_BATCHES), seconds)
        return seconds

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, WarmUp):
                item.abandon("the prefill engine is closed")

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        if self._m.device.type == "cuda":
            torch.cuda.set_device(self._m.device)
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if isinstance(batch, WarmUp):
                batch.run(self._warm_up)
                continue
            with self._count_lock:
                self._num_waiting -= len(batch)
            batch = [p for p in batch if not p.future.cancelled() and not _expired(p)]
            if not batch:
                continue
            started = time.perf_counter()
            self._num_running = len(batch)
            try:
                results = self._prefill(
                    [p.prompt_token_ids for p in batch],
                    [p.params for p in batch],
                    [p.num_generated for p in batch],
                    [p.grammar for p in batch],
                )
            except Exception as exc:
                logger.exception("prefill forward of %d requests failed", len(batch))
                for p in batch:
                    p.loop.call_soon_threadsafe(_set_exception, p.future, exc)
                continue
            finally:
                self._num_running = 0
            for p, result in zip(batch, results, strict=True):
                queued = dataclasses.replace(result, queue_seconds=started - p.submitted)
                p.loop.call_soon_threadsafe(_set_result, p.future, queued)

    def _next_batch(self) -> list[_Pending] | WarmUp | None:
        first = self._held or self._queue.get()
        self._held = None
        if first is None or isinstance(first, WarmUp):
            return first
        batch = [first]
        if first.params.prompt_logprobs is not None:
            return batch  # alone: its forward keeps every position's logits
        longest = len(first.prompt_token_ids)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch
            if item is None:
                self._queue.put(None)
                return batch
            if isinstance(item, WarmUp):
                self._held = item
                return batch
            longest_if_added = max(longest, len(item.prompt_token_ids))
            if (
                longest_if_added * (len(batch) + 1) > self._max_batch_tokens
                or item.params.prompt_logprobs is not None
            ):
                self._held = item
                return batch
            batch.append(item)
            longest = longest_if_added

    def _warm_up(self) -> None:
        vocab_size = self._m.limits.vocab_size
        params = SamplingParams(max_tokens=1, temperature=0.0)  # complete at the first token: no KV packed
        for lengths in WARM_UP_BATCHES:
            prompts = [[(row + i) % vocab_size for i in range(n)] for row, n in enumerate(lengths)]
            self._prefill(prompts, [params] * len(prompts), [0] * len(prompts))

    def _prefill(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        num_generated: Sequence[int],
        grammars: Sequence[GrammarState | None] = (),
    ) -> list[PrefillResult]:
        m = self._m
        start = time.perf_counter()
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        input_ids = torch.zeros((len(prompts), longest), dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - lengths[row] :] = torch.tensor(prompt)
            mask[row, longest - lengths[row] :] = 1
        cache = DynamicCache(config=m.model.config)
        kwargs = {}
        if len(prompts) > 1:  # left padding: every row ends at the last position
            kwargs = {
                "attention_mask": mask.to(m.device),
                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0).to(m.device),
            }
        keep = max([lengths[row] for row, p in enumerate(params) if p.prompt_logprobs is not None] or [1])
        out = m.forward(
            input_ids=input_ids.to(m.device), cache=cache, use_cache=True, logits_to_keep=keep, **kwargs
        )
        logits = out.logits[:, -1]
        apply_masks(logits, grammars)
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        results = []
        for row, (row_params, step) in enumerate(zip(params, num_generated, strict=True)):
            processor = request_processor(row_params, m.limits.eos_token_ids, prompts[row], step)
            row_logits = processor.apply(logits[row]) if processor is not None else logits[row]
            choices = first_tokens(row_logits, row_params, step, m.limits.eos_token_ids, self._token_text)
            if grammars and (grammar := grammars[row]) is not None:
                choices = with_grammar(choices, grammar)
            token, reason = choices[0].token_id, choices[0].finish_reason
            buffer = None
            if continues(choices):
                buffer = self._space.allocate(m.kv_layout.num_bytes(lengths[row]))
                pack_into(buffer.tensor, layers, m.kv_layout, row, longest - lengths[row], lengths[row])
            result = PrefillResult(token, reason, buffer, lengths[row], 0.0, len(prompts), choices=choices)
            if row_params.logprobs is not None or row_params.prompt_logprobs is not None:
                result = _with_logprobs(result, out.logits[row], prompts[row], row_params)
            results.append(result)
        if m.device.type == "cuda":
            torch.cuda.synchronize(m.device)
        elapsed = time.perf_counter() - start
        return [dataclasses.replace(r, forward_seconds=elapsed) for r in results]

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


def _expired(pending: _Pending) -> bool:
    """Whether ``pending``'s deadline passed (it is then failed with DeadlineExpired)."""
    if pending.deadline is None or time.monotonic() < pending.deadline:
        return False
    pending.loop.call_soon_threadsafe(_set_exception, pending.future, DeadlineExpired())
    return True


def _set_result(future: asyncio.Future[PrefillResult], result: PrefillResult) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[PrefillResult], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
