"""gRPC servicer of pdserve.v1.Decode: pull the KV, join the engine, stream tokens back.

``DecodeMany`` carries many requests over one call and sends each engine step's tokens for all of
them in one message (``pdserve.rpc.update_stream``); ``Decode`` is a DecodeMany call of one request.
Each request:
1. is validated, checked to fit the pool ever, and admitted under the decode's bound on the
   requests it holds before they run (``max_waiting``: RESOURCE_EXHAUSTED at once beyond it);
2. waits, in arrival order, until the engine can admit it soon (fewer than ``max_pulled`` requests
   pulled or pulling and not yet running), then pulls its KV (``_prepare``): a pulled KV does not
   wait long for the running set, and a request that cannot pull within ``PULL_WAIT_S`` (the
   prefill's lease would run out) is RESOURCE_EXHAUSTED;
3. joins the engine as a ``DecodeSequence`` whose emissions become its updates (a resumed request,
   ``num_generated`` > 0, continues at the step after its first token's);
4. ends at its last update (finish reason, or the engine's error as a status); cancelling the call
   or the request cancels its sequence. Its ``timeout_s`` is its deadline: once it passed, the
   request ends with DEADLINE_EXCEEDED wherever it is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from decode_service.engine import DecodeEngine
from decode_service.kv_pool import PrefixBlocks
from decode_service.kv_source import KvSource, PulledKv
from decode_service.metrics import DecodeMetrics
from decode_service.sequence import DeadlineExpired, DecodeSequence, Emission
from pdserve.core.grammar import Grammars, GrammarState
from pdserve.core.limits import ModelLimits
from pdserve.core.logits_processing import LogitsProcessor, request_processor
from pdserve.core.logprobs import check_count
from pdserve.core.sampling import SamplingParams
from pdserve.model.engine_model import ForwardUnavailable
from pdserve.rpc.errors import RpcError
from pdserve.rpc.sampling_proto import sampling_from_proto
from pdserve.rpc.update_stream import UpdateStream, serve_many, serve_one
from pdserve.v1 import decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)

PULL_WAIT_S = 20.0  # longest a request waits to pull its KV (a prefill's lease is 30 s by default)
ROOM_POLL_S = 0.005


def engine_error(error: BaseException) -> RpcError:
    """The status of a request the engine failed: UNAVAILABLE when no forward can run any more,
    DEADLINE_EXCEEDED when its deadline passed."""
    if isinstance(error, DeadlineExpired):
        return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, str(error))
    code = grpc.StatusCode.UNAVAILABLE if isinstance(error, ForwardUnavailable) else grpc.StatusCode.INTERNAL
    return RpcError(code, f"decode failed: {error}")


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(
        self,
        engine: DecodeEngine,
        kv_source: KvSource,
        metrics: DecodeMetrics,
        limits: ModelLimits,
        max_waiting: int = 256,
        max_pulled: int = 64,
        grammars: Grammars | None = None,
    ) -> None:
        self._engine = engine
        self._grammars = grammars  # None: structured outputs are refused
        self._limits = limits
        self._kv_source = kv_source
        self._metrics = metrics
        self._max_waiting = max_waiting
        self._max_pulled = max_pulled
        self._held = 0  # requests validated and not yet submitted to the engine
        self._gated = 0  # of those, waiting for room before their pull
        self._pulling = 0  # of those, pulling
        self._room = asyncio.Lock()  # the request first in line for room holds it (FIFO)
        metrics.pull_waiting.set_function(lambda: self._gated)

    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: Any
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        async for response in serve_one(request, self._run, context):
            yield response

    async def DecodeMany(
        self, request_iterator: AsyncIterator[decode_pb2.DecodeManyRequest], context: Any
    ) -> AsyncIterator[decode_pb2.DecodeManyResponse]:
        async for response in serve_many(request_iterator, self._run):
            self._metrics.update_messages.inc()
            yield response

    async def _run(self, tag: int, request: decode_pb2.DecodeRequest, stream: UpdateStream) -> None:
        """One request of a call, until its last update; cancelling this cancels it."""
        deadline = time.monotonic() + request.timeout_s if request.timeout_s > 0 else None
        params, pulled, grammar = await self._prepare(request, deadline)
        ended = asyncio.get_running_loop().create_future()

        def emit(emission: Emission) -> None:
            if emission.error is not None:
                failure = engine_error(emission.error)
                stream.post(tag, emission.token_ids, code=failure.code, message=failure.message)
            else:
                stream.post(tag, emission.token_ids, emission.finish_reason or "", logprobs=emission.logprobs)
            if emission.is_last and not ended.done():
                ended.set_result(None)

        seq = DecodeSequence(
            request.request_id,
            pulled.layers,
            request.first_token_id,
            params,
            emit,
            loop=asyncio.get_running_loop(),
            release_kv=pulled.release,
            deadline=deadline,
            num_generated=request.num_generated + 1,
            grammar=grammar,
            processor=decode_processor(request, params, self._limits.eos_token_ids),
            prefix_blocks=PrefixBlocks(
                request.kv_handle.prefill_instance_id,
                request.kv_handle.block_size,
                tuple(request.kv_handle.block_ids),
            ),
        )
        self._engine.submit(seq)
        try:
            await ended
        finally:
            seq.cancel()

    async def _prepare(
        self, request: decode_pb2.DecodeRequest, deadline: float | None
    ) -> tuple[SamplingParams, PulledKv, GrammarState | None]:
        """Validates a request, waits for room and pulls its KV; raises RpcError with the status to
        answer."""
        self._metrics.requests.inc()
        try:
            params = sampling_from_proto(request.sampling)
            if not params.is_greedy and params.seed is None:
                raise ValueError("sampling.seed must be set on decode requests that sample")
            if params.n != 1:  # each choice of a request decodes as a request of its own
                raise ValueError(f"sampling.n must be 1 on decode requests, got {params.n}")
            if not request.HasField("kv_handle"):
                raise ValueError("kv_handle is required")
            if not request.timeout_s >= 0:  # also NaN
                raise ValueError(f"timeout_s must be >= 0 (0: none), got {request.timeout_s}")
            if not 0 <= request.first_token_id < self._limits.vocab_size:
                raise ValueError(
                    f"first_token_id {request.first_token_id} is outside the vocabulary "
                    f"[0, {self._limits.vocab_size})"
                )
            if request.kv_handle.num_tokens + params.max_tokens > self._limits.max_model_len:
                raise ValueError(
                    f"kv_handle.num_tokens ({request.kv_handle.num_tokens}) + sampling.max_tokens must "
                    f"be <= the model's context {self._limits.max_model_len}"
                )
            _check_resumed(request, params)
            check_count("sampling.logprobs", params.logprobs, self._limits.vocab_size)
            grammar = await self._grammar(request, params)
            self._limits.check_sampling(params)
            _check_history(request, params, self._limits.vocab_size)
        except ValueError as exc:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        needed = request.kv_handle.num_tokens + params.max_tokens - 1 - request.num_generated
        if not self._engine.fits_ever(needed):
            raise RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request needs {needed} KV positions, more than this decode's whole pool",
            )
        if self._held + self._engine.num_waiting >= self._max_waiting:
            self._metrics.shed.inc()
            raise RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the decode holds {self._max_waiting} requests that wait to run; retry later",
            )
        self._held += 1
        try:
            await self._wait_for_room(deadline)
            self._pulling += 1
            try:
                pulled = await self._kv_source.take(request.kv_handle)
            finally:
                self._pulling -= 1
        except RpcError as exc:
            logger.warning("request %s: %s", request.request_id, exc.message)
            raise
        finally:
            self._held -= 1
        return params, pulled, grammar

    async def _grammar(
        self, request: decode_pb2.DecodeRequest, params: SamplingParams
    ) -> GrammarState | None:
        """The structured output's state after the request's generated tokens, first token included
        (built off the event loop); ValueError when they do not fit it."""
        generated = request.generated_token_ids
        if params.structured_output is None:
            if generated:
                raise ValueError("generated_token_ids is only for requests with a structured output")
            return None
        if self._grammars is None:
            raise ValueError("this decode serves no structured output")
        if len(generated) != request.num_generated:
            raise ValueError(
                f"generated_token_ids has {len(generated)} ids; a structured output needs the "
                f"num_generated = {request.num_generated} tokens before first_token_id"
            )
        tokens = [*generated, request.first_token_id]
        if any(not 0 <= t < self._limits.vocab_size for t in tokens):
            raise ValueError(
                f"generated_token_ids must be inside the vocabulary [0, {self._limits.vocab_size})"
            )
        return await asyncio.to_thread(
            self._grammars.start, params.structured_output, tokens, params.ignore_eos
        )

    async def _wait_for_room(self, deadline: float | None) -> None:
        """Returns once the engine can admit one more request soon; in arrival order."""
        self._gated += 1
        try:
            async with self._room:
                give_up = time.monotonic() + PULL_WAIT_S
                while self._pulling + self._engine.num_waiting >= self._max_pulled:
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        self._metrics.deadline_expired.inc()
                        raise RpcError(
                            grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed in decode"
                        )
                    if now >= give_up:
                        self._metrics.shed.inc()
                        raise RpcError(
                            grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"the decode could not admit the request within {PULL_WAIT_S:.0f} s; retry later",
                        )
                    await asyncio.sleep(ROOM_POLL_S)
        finally:
            self._gated -= 1


def _check_resumed(request: decode_pb2.DecodeRequest, params: SamplingParams) -> None:
    """A resumed request's ``num_generated``: below max_tokens, and its tokens inside the KV."""
    if request.num_generated >= params.max_tokens:
        raise ValueError(
            f"num_generated = {request.num_generated} must be below sampling.max_tokens = {params.max_tokens}"
        )
    if request.num_generated >= request.kv_handle.num_tokens:
        raise ValueError(
            f"num_generated = {request.num_generated} must be below kv_handle.num_tokens = "
            f"{request.kv_handle.num_tokens} (the KV holds the prompt, then the generated tokens)"
        )


def _check_history(request: decode_pb2.DecodeRequest, params: SamplingParams, vocab_size: int) -> None:
    """``prompt_token_ids``: the KV's tokens when the penalties need them, else none."""
    ids = request.prompt_token_ids
    if not ids and not params.needs_history:
        return
    if len(ids) != request.kv_handle.num_tokens:
        raise ValueError(
            f"prompt_token_ids has {len(ids)} ids; it must hold the KV's kv_handle.num_tokens = "
            f"{request.kv_handle.num_tokens} (the penalties count them)"
        )
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise ValueError(f"prompt_token_ids[{i}] = {token} is outside the vocabulary [0, {vocab_size})")


def decode_processor(
    request: decode_pb2.DecodeRequest, params: SamplingParams, eos_token_ids: frozenset[int]
) -> LogitsProcessor | None:
    """The logits processors of a validated request, its first token counted as output."""
    processor = request_processor(
        params, eos_token_ids, list(request.prompt_token_ids), request.num_generated
    )
    if processor is not None:
        processor.append(request.first_token_id)
    return processor
