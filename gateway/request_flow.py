"""One request through the disaggregated path, as the gateway drives it.

1. tokenize and validate the request; choose a seed when it samples without one;
2. Prefill on the least-loaded serving prefill: its forward samples the first token and parks the KV;
3. stream that first token to the client at once (detokenized, stop strings applied);
4. if the request is complete at its first token, it ends here: decode is never called;
5. otherwise decode on the least-loaded serving decode with the KV handle, relaying its tokens
   (the gateway's requests to one decode share one DecodeMany call: ``gateway.decode_mux``). When
   a decode is serving, the request is sent to it just before the first token is streamed, so
   that the decode's KV pull is not queued behind the gateway's writes to its clients;
6. a stop string ends the stream and cancels decode; if the request ends in any way before decode
   has pulled the KV (client cancel, error, stop), the KV is released on the prefill.
A request with ``n`` > 1 choices is prefilled once; from its first token on, each choice runs steps
3 to 6 on its own, all at once (``gateway.choice_streams``), and its responses carry its index.
Its request-level metrics (``gateway.request_metrics``) are observed along the way. A prefill
holding a request's parked KV stays open until the request ends, even when DNS no longer lists it.

Failures. An attempt fails when its call ends with UNAVAILABLE, DEADLINE_EXCEEDED or ABORTED (or
CANCELLED by the backend), or when its backend stops answering health checks (a killed or hung
process: the call is then cancelled). A draining decode finishes its streams within its grace
period; those still running after it end with UNAVAILABLE and fail the same way.
- a failed Prefill runs on another prefill, up to MAX_ATTEMPTS times per prefill stage;
- a failed Decode *migrates*: the request is prefilled again with the prompt followed by every
  token already relayed to the client, at the sampling step after them (``num_generated``: the
  request's random stream is indexed by step, and every finish rule counts the whole request), and
  that prefill's token is streamed and decoded on from its KV as the first token was. The client
  sees one stream, token for token what an undisturbed run gives (greedy, or seeded: the gateway
  chose the seed of a request that samples without one). The text stream (detokenizer and
  stop-string holdback) goes on across the move, so no text is repeated or skipped. The KV parked by
  the failed attempt and not pulled is released. A decode that answers ABORTED could not get the KV
  from its prefill (the prefill died or its pair broke before the pull): the new prefill is another
  one, and the same decode may run it; otherwise the next decode is another one when one serves.
A request moves at most MAX_MIGRATIONS times; the next failure, or no decode or prefill left to
run it, ends the stream with UNAVAILABLE and a message saying how many tokens were delivered.

Overload and deadlines. A prefill that answers RESOURCE_EXHAUSTED (its queue is full) is left for
another prefill not tried yet; with none left, and for a full decode, the request is shed to the
client with RESOURCE_EXHAUSTED. A request's deadline, when it has one, bounds every backend call
(the time left is the Prefill call's timeout and the DecodeRequest's ``timeout_s``); once it has
passed, the request ends with DEADLINE_EXCEEDED and is not run again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from gateway.backend_health import BackendHealth
from gateway.backends import Backend, BackendPool, Chooser
from gateway.bad_words import resolved
from gateway.choice_streams import choice_answers, choices_params, merged
from gateway.decode_mux import DecodeFailure, DecodeMux, MuxedRequest
from gateway.metrics import GatewayMetrics
from gateway.prefix_router import PrefixRouter, Routed
from gateway.prompt_input import PromptInput
from gateway.request_metrics import RequestTimer
from gateway.text_stream import TextChunk, TextStream
from pdserve.core.finish import EOS, STOP
from pdserve.core.grammar import grammar_of
from pdserve.core.sampling import SamplingParams
from pdserve.kv.handle import describe
from pdserve.rpc.errors import RpcError, status_code
from pdserve.rpc.sampling_proto import sampling_to_proto
from pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    kv_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    sampling_pb2,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
PrefillBackend = Backend[prefill_pb2_grpc.PrefillStub]
DecodeBackend = Backend[decode_pb2_grpc.DecodeStub]

RELEASE_TIMEOUT_S = 5.0
MAX_ATTEMPTS = 3  # prefill calls per prefill stage (the first, then others after failures)
MAX_MIGRATIONS = 3  # times one request's decode may be lost and the request continued elsewhere
RETRIABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)


class _AttemptFailed(Exception):
    def __init__(self, code: grpc.StatusCode, where: str, details: str, by_backend: bool = False) -> None:
        super().__init__(f"{where} failed ({code.name}: {details})")
        self.code = code
        self.where = where
        self.details = details
        self.by_backend = by_backend  # the backend ended the call itself (not the gateway)

    @property
    def retriable(self) -> bool:
        return self.code in RETRIABLE or (self.by_backend and self.code == grpc.StatusCode.CANCELLED)

    def error(self, delivered: int) -> RpcError:
        if self.code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ):
            return RpcError(self.code, self.details)
        if self.code == grpc.StatusCode.CANCELLED:
            return RpcError(self.code, f"{self.where} cancelled the request")
        return RpcError(grpc.StatusCode.UNAVAILABLE, f"{self} after {delivered} tokens were delivered")


@dataclass
class _Parked:
    prefill: PrefillBackend
    handle: kv_pb2.KvHandle
    pulled: bool = False
    let_go: bool = False


@dataclass
class _Progress:
    """What one request has streamed so far, across the decodes it moved between."""

    request_id: str
    prompt_ids: list[int]
    sampling: Any
    text: TextStream
    delivered: list[int] = field(default_factory=list)  # token ids relayed to the client, in order
    history: bool = False  # decode needs the KV's token ids (the penalties count them)
    hide_stop_token: bool = True  # a stop token's text is not returned (include_stop_str_in_output off)
    stop_token_ids: frozenset[int] = frozenset()
    cached_tokens: int = 0  # of the prompt's, from the prefill's prefix cache (first message)

    @classmethod
    def of(
        cls, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, tokenizer: Any
    ) -> _Progress:
        """A request (or one of its choices) that has streamed nothing yet."""
        return cls(
            request_id,
            list(prompt_ids),
            sampling_to_proto(params),
            TextStream(tokenizer, params, prompt_ids),
            history=params.needs_history,
            hide_stop_token=not params.include_stop_str_in_output,
            stop_token_ids=frozenset(params.stop_token_ids),
        )

    def prefill_request(self) -> prefill_pb2.PrefillRequest:
        """The prefill of the request from where it is: the prompt, then every delivered token
        (the prompt's logprobs, delivered with the first token, are not asked for again)."""
        sampling = self.sampling
        if self.delivered and sampling.HasField("prompt_logprobs"):
            sampling = sampling_pb2.SamplingParams()
            sampling.CopyFrom(self.sampling)
            sampling.ClearField("prompt_logprobs")
        return prefill_pb2.PrefillRequest(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_ids + self.delivered,
            sampling=sampling,
            num_generated=len(self.delivered),
        )

    def relay(
        self,
        token_ids: list[int],
        reason: str | None,
        logprobs: Sequence[sampling_pb2.TokenLogprobs] = (),
        prompt_logprobs: Sequence[sampling_pb2.TokenLogprobs] = (),
    ) -> tuple[gateway_pb2.GenerateResponse, str | None]:
        """The response carrying ``token_ids`` (the text they make final, stop strings applied) and
        the request's finish reason after them; its tokens count as delivered. ``logprobs``: one
        per token (the response keeps those of the tokens it carries); ``prompt_logprobs`` go on
        the first response."""
        stop_token = self._stop_token(token_ids, reason)
        if stop_token is not None and self.hide_stop_token:  # its text is left out, as vLLM
            chunk = self.text.add(token_ids[:-1])
            if not chunk.stopped:
                chunk = TextChunk([*chunk.token_ids, stop_token], chunk.text, False)
        else:
            chunk = self.text.add(token_ids)
        reason = STOP if chunk.stopped else reason
        if reason is not None and not chunk.stopped:
            chunk = _join(chunk, self.text.finish())
        first = not self.delivered
        self.delivered.extend(chunk.token_ids)
        response = _response(
            chunk,
            reason,
            request_id=self.request_id if first else "",
            num_prompt_tokens=len(self.prompt_ids) if first else 0,
            num_cached_tokens=self.cached_tokens if first else 0,
        )
        response.logprobs.extend(logprobs[: len(chunk.token_ids)])
        if first:
            response.prompt_logprobs.extend(prompt_logprobs)
        if chunk.stopped and self.text.matched is not None:
            response.stop_string = self.text.matched
        elif reason == STOP and stop_token is not None:
            response.stop_token_id = stop_token
        return response, reason

    def _stop_token(self, token_ids: list[int], reason: str | None) -> int | None:
        """The token that ends the request by the token rules (EOS, a stop token), or None (a stop
        string in the prefill's token also ends it with "stop")."""
        if not token_ids or reason not in (STOP, EOS):
            return None
        last = token_ids[-1]
        return last if reason == EOS or last in self.stop_token_ids else None

    def kv_token_ids(self, step: int) -> list[int]:
        """The token ids the KV of the prefill's token at ``step`` holds, when decode needs them."""
        return self.prompt_ids + self.delivered[:step] if self.history else []


class RequestFlow:
    def __init__(
        self,
        prompts: PromptInput,
        tokenizer: Any,
        prefills: BackendPool[prefill_pb2_grpc.PrefillStub],
        decodes: BackendPool[decode_pb2_grpc.DecodeStub],
        metrics: GatewayMetrics,
        prefill_router: PrefixRouter | None = None,
    ) -> None:
        self._prompts = prompts
        self._prefill_router = prefill_router
        self._tokenizer = tokenizer
        self._prefills = prefills
        self._decodes = decodes
        self._metrics = metrics
        self._background: set[asyncio.Task[None]] = set()
        self._muxes: dict[DecodeBackend, DecodeMux] = {}
        for stage in ("prefill", "decode"):
            metrics.retries.labels(stage)  # exported at 0 from the start
        for role, pool in (("prefill", prefills), ("decode", decodes)):
            metrics.backends_serving.labels(role).set_function(pool_size(pool, serving=True))
            metrics.backends.labels(role).set_function(pool_size(pool))
            metrics.backends_retired.labels(role).set_function(pool_size(pool, retired=True))
        decodes.on_closed(self._forget_decode)
        if prefill_router is not None:
            prefills.on_closed(lambda backend: prefill_router.forget(backend.address))

    async def generate(
        self, request: gateway_pb2.GenerateRequest, params: SamplingParams, deadline: float | None = None
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """The request's responses; ``deadline`` (``time.monotonic()``), when set, bounds it: each
        backend call gets the time left as its timeout, and the request ends with DEADLINE_EXCEEDED
        once it passed."""
        timer = self._metrics.request.timer()
        unfinished = params.n  # choices still going
        try:
            async for response in self._generate(request, params, timer, Deadline(deadline)):
                timer.sent(len(response.token_ids))
                if response.finish_reason:
                    unfinished -= 1
                    if not unfinished:
                        timer.finished(response.finish_reason)
                yield response
        except ValueError:
            timer.rejected()
            raise
        finally:
            timer.aborted()

    async def _generate(
        self,
        request: gateway_pb2.GenerateRequest,
        params: SamplingParams,
        timer: RequestTimer,
        deadline: Deadline,
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        request_id = request.request_id or secrets.token_hex(8)
        if (structured := params.structured_output) is not None:  # refused before any backend call
            await self._prompts.off_loop(lambda: grammar_of(structured))
        if params.bad_words:
            given = params
            params = await self._prompts.off_loop(lambda: resolved(given, self._tokenizer))
        prompt_ids = await self._prompts.token_ids(request, params)
        if not params.is_greedy and params.seed is None:
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        started = time.perf_counter()
        run = _Progress.of(request_id, prompt_ids, params, self._tokenizer)

        prefill, first, sent_at = await self._prefill(
            run.prefill_request(), timer, avoid=(), delivered=0, deadline=deadline
        )
        self._metrics.ttft_seconds.observe(time.perf_counter() - started)
        timer.prefilled(sent_at, first.queue_seconds, len(prompt_ids))
        if params.n == 1:
            runs, answers = [run], [first]
        else:
            runs = [
                _Progress.of(request_id, prompt_ids, choice, self._tokenizer)
                for choice in choices_params(params)
            ]
            answers = choice_answers(first, params.n)
        for r in runs:
            r.cached_tokens = first.cached_tokens
        parked = [_park(prefill, a.kv_handle) if a.HasField("kv_handle") else None for a in answers]
        try:
            streams = [
                self._choice(r, a, p, timer, deadline) for r, a, p in zip(runs, answers, parked, strict=True)
            ]
            if len(streams) == 1:
                async for response in streams[0]:
                    yield response
            else:
                async for response in merged(streams):
                    yield response
        finally:
            for p in parked:  # a choice that never started still holds its KV
                if p is not None:
                    self._let_go(p)

    async def _choice(
        self,
        run: _Progress,
        first: prefill_pb2.PrefillResponse,
        parked: _Parked | None,
        timer: RequestTimer,
        deadline: Deadline,
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """One choice's responses from its prefill's answer ``first`` (its KV ``parked``) on: its
        first token, then decode, moving to another decode when one is lost."""
        sent: tuple[DecodeBackend, MuxedRequest] | None = None  # sent to a decode, not yet read
        failed_decodes: list[DecodeBackend] = []
        migrations = 0
        try:
            while True:  # one prefill's answer, then decode from its KV
                step = len(run.delivered)  # the sampling step of the prefill's token
                response, reason = run.relay(
                    [first.first_token_id],
                    first.finish_reason or None,
                    [first.first_token_logprobs] if first.HasField("first_token_logprobs") else [],
                    first.prompt_logprobs,
                )
                if reason is None and parked is not None:
                    early = self._decodes.pick_now(failed_decodes)
                    if early is not None:
                        sent = (early, self._start(early, run, parked, first.first_token_id, step, deadline))
                yield response
                if reason is not None:
                    self._metrics.finished.labels(reason).inc()
                    return
                if parked is None:
                    raise RpcError(
                        grpc.StatusCode.INTERNAL, "prefill returned neither a finish reason nor a KV handle"
                    )
                decode: DecodeBackend
                if sent is not None:
                    decode, muxed = sent
                    sent = None
                else:
                    decode = await self._pick(self._decodes, failed_decodes, delivered=len(run.delivered))
                    muxed = self._start(decode, run, parked, first.first_token_id, step, deadline)
                try:
                    async for response in self._decode(decode, muxed, parked, run):
                        yield response
                    return
                except _AttemptFailed as failure:
                    deadline.check(delivered=len(run.delivered))
                    if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        self._metrics.shed.labels("decode").inc()
                    migrations += 1
                    if not failure.retriable:
                        raise failure.error(delivered=len(run.delivered)) from None
                    if migrations > MAX_MIGRATIONS:
                        raise RpcError(
                            grpc.StatusCode.UNAVAILABLE,
                            f"{failure}; the request lost its decode {migrations} times and is not "
                            f"moved again, after {len(run.delivered)} tokens were delivered",
                        ) from None
                    logger.warning(
                        "request %s: %s after %d tokens were delivered; continuing it on another decode",
                        run.request_id,
                        failure,
                        len(run.delivered),
                    )
                    self._metrics.retries.labels("decode").inc()
                    self._metrics.migrated_tokens.inc(len(run.delivered))
                    failed_prefill = parked.prefill
                    self._let_go(parked)
                    parked = None
                    if failure.code != grpc.StatusCode.ABORTED:
                        failed_decodes.append(decode)
                    avoid = [failed_prefill] if failure.code == grpc.StatusCode.ABORTED else []
                    prefill, first, _ = await self._prefill(
                        run.prefill_request(), timer, avoid, delivered=len(run.delivered), deadline=deadline
                    )
                    parked = _park(prefill, first.kv_handle) if first.HasField("kv_handle") else None
        finally:
            if sent is not None:  # the client went away before decode was read
                _end(*sent)
            if parked is not None:
                self._let_go(parked)

    def _let_go(self, parked: _Parked) -> None:
        """The request is done with ``parked``: released on its prefill unless a decode pulled it
        (once: letting go again does nothing)."""
        if parked.let_go:
            return
        parked.let_go = True
        if parked.pulled:
            parked.prefill.holds -= 1
        else:
            self._release_later(parked)

    async def _pick(
        self,
        pool: BackendPool[T],
        avoid: Collection[Backend[T]],
        delivered: int,
        choose: Chooser[T] | None = None,
    ) -> Backend[T]:
        try:
            return await pool.pick(avoid, choose)
        except RpcError as exc:
            if delivered:
                raise RpcError(exc.code, f"{exc.message}; {delivered} tokens were delivered") from None
            raise

    async def _prefill(
        self,
        request: prefill_pb2.PrefillRequest,
        timer: RequestTimer,
        avoid: Collection[PrefillBackend],
        delivered: int,
        deadline: Deadline,
    ) -> tuple[PrefillBackend, prefill_pb2.PrefillResponse, float]:
        """The prefill that answered, its answer and when the call was sent (``timer``'s clock).
        A prefill whose queue is full (RESOURCE_EXHAUSTED) is left for another one not tried yet;
        when there is none, the request is shed."""
        failed = list(avoid)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            routed: list[Routed] = []
            prefill = await self._pick(
                self._prefills, failed, delivered, self._prefill_chooser(request, routed)
            )
            new_tokens = routed[-1].new_tokens if routed and routed[-1].address == prefill.address else 0
            timeout = deadline.remaining(delivered)
            prefill.outstanding += 1
            prefill.pending_tokens += new_tokens
            sent_at = timer.now()
            call = prefill.stub.Prefill(request, timeout=timeout)
            try:
                response = await _guarded(prefill.health, call, call, f"prefill {prefill.address}")
                if self._prefill_router is not None:
                    self._prefill_router.learn_capacity(prefill.address, response.prefix_cache_tokens)
                return prefill, response, sent_at
            except grpc.aio.AioRpcError as exc:
                prefill.health.call_failed(exc.code(), exc.details() or "")
                failure = _AttemptFailed(exc.code(), f"prefill {prefill.address}", exc.details() or "")
            except _AttemptFailed as exc:
                failure = exc
            finally:
                prefill.outstanding -= 1
                prefill.pending_tokens -= new_tokens
            deadline.check(delivered)
            failed.append(prefill)
            if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                if attempt == MAX_ATTEMPTS or self._prefills.pick_now(failed) in (None, *failed):
                    self._metrics.shed.labels("prefill").inc()
                    raise failure.error(delivered)
                logger.info("request %s: %s; trying another prefill", request.request_id, failure)
                continue
            if not failure.retriable or attempt == MAX_ATTEMPTS:
                raise failure.error(delivered)
            logger.warning("request %s: %s; running it again", request.request_id, failure)
            self._metrics.retries.labels("prefill").inc()
        raise AssertionError("unreachable")

    def _prefill_chooser(
        self, request: prefill_pb2.PrefillRequest, routed: list[Routed]
    ) -> Chooser[prefill_pb2_grpc.PrefillStub] | None:
        """The prefix router's choice for ``request`` (None: the least loaded prefill); each choice
        is appended to ``routed``."""
        router = self._prefill_router
        if router is None:
            return None

        def choose(serving: Sequence[PrefillBackend]) -> PrefillBackend:
            chosen, choice = router.choose(request.prompt_token_ids, serving)
            self._metrics.prefill_routes.labels(choice.outcome).inc()
            routed.append(choice)
            return chosen

        return choose

    def _start(
        self,
        decode: DecodeBackend,
        run: _Progress,
        parked: _Parked,
        token_id: int,
        step: int,
        deadline: Deadline,
    ) -> MuxedRequest:
        """Sends one decode attempt to ``decode``, going on after ``token_id``, the token ``parked``'s
        prefill sampled at ``step``; ``_decode`` reads it, ``_end`` ends it."""
        timeout_s = deadline.remaining(delivered=step + 1) or 0.0
        decode.outstanding += 1
        self._metrics.decode_calls.inc()
        return self._mux(decode).start(
            decode_pb2.DecodeRequest(
                request_id=run.request_id,
                kv_handle=parked.handle,
                first_token_id=token_id,
                sampling=run.sampling,
                timeout_s=timeout_s,
                num_generated=step,
                # a structured output's decode rebuilds its grammar from every token before
                generated_token_ids=run.delivered[:step]
                if run.sampling.HasField("structured_output")
                else (),
                prompt_token_ids=run.kv_token_ids(step),
            )
        )

    async def _decode(
        self, decode: DecodeBackend, muxed: MuxedRequest, parked: _Parked, run: _Progress
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """One decode attempt's responses; raises _AttemptFailed."""
        where = f"decode {decode.address}"
        try:
            while True:
                try:
                    update = await muxed.next()
                except DecodeFailure as exc:
                    if not exc.backend_down and not exc.local and exc.code != grpc.StatusCode.ABORTED:
                        decode.health.call_failed(exc.code, exc.details)
                    raise _AttemptFailed(exc.code, where, exc.details, by_backend=not exc.local) from None
                if update.error_code:
                    code = status_code(update.error_code)
                    if code != grpc.StatusCode.ABORTED:
                        decode.health.call_failed(code, update.error_message)
                    raise _AttemptFailed(code, where, update.error_message)
                parked.pulled = True  # decode answers only after its pull
                response, reason = run.relay(
                    list(update.token_ids), update.finish_reason or None, update.logprobs
                )
                yield response
                if reason is not None:
                    self._metrics.finished.labels(reason).inc()
                    return
        finally:
            _end(decode, muxed)

    def _mux(self, decode: DecodeBackend) -> DecodeMux:
        mux = self._muxes.get(decode)
        if mux is None:
            mux = self._muxes[decode] = DecodeMux(decode.stub, decode.health)
        return mux

    def _release_later(self, parked: _Parked) -> None:
        prefill, handle = parked.prefill, parked.handle

        async def release() -> None:
            try:
                response = await prefill.stub.ReleaseKv(
                    prefill_pb2.ReleaseKvRequest(handle_id=handle.id), timeout=RELEASE_TIMEOUT_S
                )
                if response.released:
                    self._metrics.kv_releases.inc()
            except grpc.aio.AioRpcError as exc:
                logger.warning("release of %s failed: %s", describe(handle), exc.details())
            finally:
                prefill.holds -= 1

        self._in_background(release())

    def _forget_decode(self, decode: DecodeBackend) -> None:
        """A decode that left the pool is closed: its mux (no request left on it) goes too."""
        mux = self._muxes.pop(decode, None)
        if mux is not None:
            self._in_background(mux.close())

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        await asyncio.gather(*(mux.close() for mux in self._muxes.values()))
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


class Deadline:
    """A request's deadline (``time.monotonic()`` seconds; None: none)."""

    def __init__(self, at: float | None) -> None:
        self.at = at

    def remaining(self, delivered: int) -> float | None:
        """Seconds left (the timeout of the next backend call); raises DEADLINE_EXCEEDED when none."""
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise self._exceeded(delivered)
        return left

    def check(self, delivered: int) -> None:
        """A failed attempt is not run again once the deadline passed: DEADLINE_EXCEEDED."""
        if self.at is not None and time.monotonic() >= self.at:
            raise self._exceeded(delivered) from None

    def _exceeded(self, delivered: int) -> RpcError:
        return RpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the request's deadline passed after {delivered} tokens were delivered",
        )


def pool_size(pool: BackendPool[Any], serving: bool = False, retired: bool = False) -> Callable[[], int]:
    """A gauge's function: the pool's backends (only those serving), or its retired ones."""
    if retired:
        return lambda: len(pool.retired)
    if serving:
        return lambda: pool.num_serving
    return lambda: len(pool.backends)


def _park(prefill: PrefillBackend, handle: kv_pb2.KvHandle) -> _Parked:
    """A request's KV parked on ``prefill``: the prefill is held until the KV is pulled or released."""
    prefill.holds += 1
    return _Parked(prefill, handle)


def _end(decode: DecodeBackend, muxed: MuxedRequest) -> None:
    """Ends a decode attempt here (cancelling it on the decode if it still runs)."""
    decode.outstanding -= 1
    muxed.close()


async def _guarded(health: BackendHealth, awaitable: Awaitable[T], call: grpc.aio.Call, where: str) -> T:
    """Awaits a step of ``call``; cancels the call and raises _AttemptFailed if its backend goes down."""
    step = asyncio.ensure_future(awaitable)
    down = asyncio.ensure_future(health.down.wait())
    try:
        done, _ = await asyncio.wait({step, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        down.cancel()
        if not step.done():
            step.cancel()
            call.cancel()
    if step in done:
        return step.result()
    raise _AttemptFailed(grpc.StatusCode.UNAVAILABLE, where, f"backend is down ({health.reason})")


def _join(a: TextChunk, b: TextChunk) -> TextChunk:
    return TextChunk(a.token_ids + b.token_ids, a.text + b.text, a.stopped or b.stopped)


def _response(
    chunk: TextChunk,
    reason: str | None,
    request_id: str = "",
    num_prompt_tokens: int = 0,
    num_cached_tokens: int = 0,
) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        token_ids=chunk.token_ids,
        text=chunk.text,
        finish_reason=reason or "",
        request_id=request_id,
        num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=num_cached_tokens,
    )
