"""gRPC servicer of pdserve.v1.Prefill: converts at the edge, delegates to engine, registry and sender.

``KvHandoffServicer`` serves the handoff calls alone (PullKvMany, its one-handle form PullKv, and
ReleaseKv); ``PrefillServicer`` adds the prompt forward. ``pdserve bench-kv`` runs the first one to
time the real pull path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import grpc

from pdserve.core.grammar import Grammars, GrammarState
from pdserve.core.sampling import SamplingParams
from pdserve.kv.channel import TransferError
from pdserve.kv.handle import HANDLE_ID_BYTES, MIN_GENERATION_METADATA, HandleIssuer, is_handle_id
from pdserve.kv.pair_secret import generation_problem, pair_key, pull_problem
from pdserve.kv.pair_store import StoreLimit, StoreTimeout, call_problem
from pdserve.kv.shared_memory import is_instance_id
from pdserve.kv.transports import KV_BACKENDS, SAME_HOST
from pdserve.model.engine_model import EngineModel, ForwardUnavailable
from pdserve.rpc.errors import RpcError, abort
from pdserve.rpc.logprobs_proto import logprobs_list_to_proto, logprobs_to_proto
from pdserve.rpc.sampling_proto import sampling_from_proto
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc
from prefill_service.choice_handles import choices_response
from prefill_service.engine import DeadlineExpired, PrefillEngine, PrefillResult
from prefill_service.kv_lender import KvLender
from prefill_service.kv_registry import KvRegistry, ParkedKv
from prefill_service.kv_sender import KvSender, PairsFull, StaleGeneration
from prefill_service.metrics import PrefillMetrics

logger = logging.getLogger(__name__)

TRANSPORTS = KV_BACKENDS[1:]
MAX_HANDLES_PER_PULL = 4096
_NOT_LENT = kv_pb2.LentKv()


class KvHandoffServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self,
        registry: KvRegistry,
        sender: KvSender,
        metrics: PrefillMetrics,
        lender: KvLender | None = None,
    ) -> None:
        self._registry = registry
        self._sender = sender
        self._metrics = metrics
        self._lender = lender if lender is not None else KvLender(is_alive=lambda decode: True)

    async def PullKv(self, request: prefill_pb2.PullKvRequest, context: Any) -> prefill_pb2.PullKvResponse:
        """PullKvMany of one handle; a handle not parked here is NOT_FOUND."""
        many = prefill_pb2.PullKvManyRequest(
            handle_ids=[request.handle_id],
            decode_instance_id=request.decode_instance_id,
            pair_generation=request.pair_generation,
            transport=request.transport,
            pair_secret=request.pair_secret,
        )
        (num_bytes,) = (await self.PullKvMany(many, context)).num_bytes
        if not num_bytes:
            await abort(context, grpc.StatusCode.NOT_FOUND, "KV handle is unknown, expired or already pulled")
        return prefill_pb2.PullKvResponse(num_bytes=num_bytes)

    async def PullKvMany(
        self, request: prefill_pb2.PullKvManyRequest, context: Any
    ) -> prefill_pb2.PullKvManyResponse:
        if not request.handle_ids:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "handle_ids is empty")
        transport = request.transport or self._sender.default_backend
        decode, secret, generation = request.decode_instance_id, request.pair_secret, request.pair_generation
        await self._check_pull(context, request.handle_ids, decode, secret, generation, transport)
        self._metrics.kv_pull_calls.inc()
        entries = [self._registry.take(handle_id, transport) for handle_id in request.handle_ids]
        found = [entry for entry in entries if entry is not None]
        self._metrics.kv_pulls_not_found.inc(len(entries) - len(found))
        lent: dict[bytes, kv_pb2.LentKv] = {}
        if found and transport in SAME_HOST:
            lent = self._lend(found, decode, secret, transport)
        elif found:
            await self._send(context, found, decode, secret, generation, transport)
        return prefill_pb2.PullKvManyResponse(
            num_bytes=[0 if e is None else e.num_bytes for e in entries],
            lent=[lent.get(handle_id, _NOT_LENT) for handle_id in request.handle_ids] if lent else [],
        )

    async def _refuse(self, context: Any, code: grpc.StatusCode, message: str) -> NoReturn:
        self._metrics.kv_pulls_refused.inc()
        await abort(context, code, message)

    async def _check_pull(
        self,
        context: Any,
        handle_ids: Sequence[bytes],
        decode: str,
        secret: bytes,
        generation: int,
        transport: str,
    ) -> None:
        """Validates a pull's fields and, over a network transport, its pair generation, before any
        handle is taken: a refused pull leaves every handle parked and every pair as it was."""
        if len(handle_ids) > MAX_HANDLES_PER_PULL:
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_HANDLES_PER_PULL} handle_ids"
            )
        if not all(is_handle_id(handle_id) for handle_id in handle_ids):
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"handle_id must be {HANDLE_ID_BYTES} bytes"
            )
        if transport not in TRANSPORTS:
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"transport must be one of {TRANSPORTS}"
            )
        problem = pull_problem(decode, secret)
        if problem is None and transport in SAME_HOST and not is_instance_id(decode):
            problem = "decode_instance_id must be lowercase hex"
        if problem is None and transport not in SAME_HOST:
            problem = generation_problem(generation)
        if problem is not None:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        if transport in SAME_HOST:
            return
        try:
            self._sender.check_generation(decode, secret, generation)
        except StaleGeneration as exc:
            await self._abort_stale(context, exc)

    def _lend(
        self, entries: Sequence[ParkedKv], decode: str, secret: bytes, transport: str
    ) -> dict[bytes, kv_pb2.LentKv]:
        """Lends taken KVs to a decode of this host; where it reads each, by handle id."""
        self._metrics.kv_pulls.inc(len(entries))
        self._metrics.kv_transport_pulls.labels(transport).inc(len(entries))
        where = self._lender.lend(entries, pair_key(decode, secret), transport)
        return {entry.handle_id: lent for entry, lent in zip(entries, where, strict=True)}

    async def _send(
        self,
        context: Any,
        entries: Sequence[ParkedKv],
        decode: str,
        secret: bytes,
        generation: int,
        backend: str,
    ) -> None:
        """Posts the send of taken KVs (one transfer) on the pair; a failure ends the call (the KVs
        are dropped)."""
        self._metrics.kv_pulls.inc(len(entries))
        self._metrics.kv_transport_pulls.labels(backend).inc(len(entries))
        try:
            self._sender.send(entries, decode, secret, generation, backend)
        except StaleGeneration as exc:  # a concurrent pull of that decode moved on: the KV is dropped
            self._metrics.kv_pull_failures.inc()
            await self._abort_stale(context, exc)
        except PairsFull as exc:
            self._metrics.kv_pull_failures.inc()
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except TransferError as exc:
            self._metrics.kv_pull_failures.inc()
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"KV send could not be posted: {exc}")

    async def ReleaseKv(
        self, request: prefill_pb2.ReleaseKvRequest, context: Any
    ) -> prefill_pb2.ReleaseKvResponse:
        released = self._registry.release(request.handle_id)
        if released:
            self._metrics.kv_releases.inc()
        elif self._lender.give_back(
            request.handle_id, pair_key(request.decode_instance_id, request.pair_secret)
        ):
            self._metrics.kv_given_back.inc()
            released = True
        return prefill_pb2.ReleaseKvResponse(released=released)

    async def PairStore(
        self, request: prefill_pb2.PairStoreRequest, context: Any
    ) -> prefill_pb2.PairStoreResponse:
        """One operation on the store of a pair generation this prefill made for that decode link."""
        keys = list(request.keys)
        problem = (
            pull_problem(request.decode_instance_id, request.pair_secret)
            or generation_problem(request.pair_generation)
            or call_problem(request.op, keys, request.value, request.expected)
        )
        if problem is not None:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        store = self._sender.pair_store(
            request.decode_instance_id, request.pair_secret, request.pair_generation
        )
        if store is None:
            await self._refuse(
                context,
                grpc.StatusCode.NOT_FOUND,
                "no open KV pair of this generation for that decode link (pull first)",
            )
        try:
            value, number, ready = await store.call(
                request.op, keys, request.value, request.expected, request.amount, request.timeout_s
            )
        except StoreLimit as exc:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except StoreTimeout as exc:
            await abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        return prefill_pb2.PairStoreResponse(value=value, number=number, ready=ready)

    async def _abort_stale(self, context: Any, exc: StaleGeneration) -> None:
        self._metrics.kv_pulls_stale.inc()
        await context.abort(
            grpc.StatusCode.ABORTED,
            str(exc),
            trailing_metadata=((MIN_GENERATION_METADATA, str(exc.minimum)),),
        )
        raise RpcError(grpc.StatusCode.ABORTED, str(exc))


class PrefillServicer(KvHandoffServicer):
    def __init__(
        self,
        engine_model: EngineModel,
        engine: PrefillEngine,
        registry: KvRegistry,
        sender: KvSender,
        metrics: PrefillMetrics,
        issuer: HandleIssuer,
        lender: KvLender,
        max_waiting: int = 1024,
        grammars: Grammars | None = None,
    ) -> None:
        super().__init__(registry, sender, metrics, lender)
        self._m = engine_model
        self._grammars = grammars or Grammars(
            engine_model.tokenizer, engine_model.limits.vocab_size, engine_model.limits.eos_token_ids
        )
        self._engine = engine
        self._issuer = issuer
        self._max_waiting = max_waiting

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:
        try:
            params = sampling_from_proto(request.sampling)
            self._m.limits.check_request(request.prompt_token_ids, params, request.num_generated)
            if not params.is_greedy and params.seed is None:
                raise ValueError("sampling.seed must be set on prefill requests that sample")
            grammar = await self._grammar(request, params)
        except ValueError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if self._engine.num_waiting >= self._max_waiting:
            self._metrics.shed.inc()
            await abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the prefill queue is full ({self._max_waiting} requests waiting); retry later",
            )
        self._metrics.requests.inc()
        self._metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            result = await self._engine.run(
                request.prompt_token_ids, params, request.num_generated, deadline, grammar
            )
        except ForwardUnavailable as exc:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"prefill could not run: {exc}")
        except DeadlineExpired:
            self._metrics.deadline_expired.inc()
            await abort(
                context, grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed in the queue"
            )
        self._metrics.forward_seconds.observe(result.forward_seconds)
        self._metrics.queue_seconds.observe(result.queue_seconds)
        self._metrics.batch_size.observe(result.batch_size)
        cache = self._engine.prefix_cache
        capacity = cache.capacity_tokens if cache is not None else 0
        if cache is not None:
            self._metrics.prefix_cache_queries.inc(len(request.prompt_token_ids))
            self._metrics.prefix_cache_hits.inc(result.cached_tokens)
            self._metrics.cached_tokens.observe(result.cached_tokens)
        if params.n > 1:
            response = choices_response(
                result, self._registry, self._issuer, self._metrics, self._block_size()
            )
            response.cached_tokens = result.cached_tokens
            response.prefix_cache_tokens = capacity
            return response
        if result.finish_reason is not None or result.kv is None:
            self._metrics.finished_at_first_token.labels(result.finish_reason or "").inc()
            return _with_logprobs(
                prefill_pb2.PrefillResponse(
                    first_token_id=result.first_token_id,
                    finish_reason=result.finish_reason or "",
                    queue_seconds=result.queue_seconds,
                    cached_tokens=result.cached_tokens,
                    prefix_cache_tokens=capacity,
                ),
                result,
            )
        entry = self._registry.park(result.kv, result.num_tokens)
        self._metrics.kv_parks.inc()
        logger.debug("request %s parked %d bytes", request.request_id, entry.num_bytes)
        return _with_logprobs(
            prefill_pb2.PrefillResponse(
                first_token_id=result.first_token_id,
                kv_handle=self._issuer.issue(entry, self._block_size(), result.block_ids),
                queue_seconds=result.queue_seconds,
                cached_tokens=result.cached_tokens,
                prefix_cache_tokens=capacity,
            ),
            result,
        )

    def _block_size(self) -> int:
        """Tokens per block of the prefix cache (0: none)."""
        cache = self._engine.prefix_cache
        return cache.block_size if cache is not None else 0

    async def _grammar(
        self, request: prefill_pb2.PrefillRequest, params: SamplingParams
    ) -> GrammarState | None:
        """The structured output's state after the tokens the request generated before (the end of
        its prompt), built off the event loop; ValueError when the spec or those tokens are refused."""
        if params.structured_output is None:
            return None
        generated = list(request.prompt_token_ids[len(request.prompt_token_ids) - request.num_generated :])
        return await asyncio.to_thread(
            self._grammars.start, params.structured_output, generated, params.ignore_eos
        )


def _with_logprobs(
    response: prefill_pb2.PrefillResponse, result: PrefillResult
) -> prefill_pb2.PrefillResponse:
    """``response`` with the logprobs of ``result`` (none when its request asked for none)."""
    if result.logprobs is not None:
        response.first_token_logprobs.CopyFrom(logprobs_to_proto(result.logprobs))
    response.prompt_logprobs.extend(logprobs_list_to_proto(result.prompt_logprobs))
    return response
