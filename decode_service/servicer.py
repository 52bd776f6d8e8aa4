"""gRPC servicer of pdserve.v1.Decode: pull the KV, join the engine, stream tokens back.

``DecodeMany`` carries many requests over one call and sends each engine step's tokens for all of
them in one message (``pdserve.rpc.update_stream``); ``Decode`` is a DecodeMany call of one request.
Each request:
1. is validated, checked to fit the pool ever, and its KV pulled (``_prepare``);
2. joins the engine as a ``DecodeSequence`` whose emissions become its updates (a resumed request,
   ``num_generated`` > 0, continues at the step after its first token's);
3. ends at its last update (finish reason, or the engine's error as a status); cancelling the call
   or the request cancels its sequence.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from decode_service.engine import DecodeEngine
from decode_service.kv_source import KvSource, PulledKv
from decode_service.metrics import DecodeMetrics
from decode_service.sequence import DecodeSequence, Emission
from pdserve.core.sampling import SamplingParams
from pdserve.model.engine_model import ForwardUnavailable
from pdserve.rpc.errors import RpcError
from pdserve.rpc.sampling_proto import sampling_from_proto
from pdserve.rpc.update_stream import UpdateStream, serve_many, serve_one
from pdserve.v1 import decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)


def engine_error(error: BaseException) -> RpcError:
    """The status of a request the engine failed: UNAVAILABLE when no forward can run any more."""
    code = grpc.StatusCode.UNAVAILABLE if isinstance(error, ForwardUnavailable) else grpc.StatusCode.INTERNAL
    return RpcError(code, f"decode failed: {error}")


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: DecodeEngine, kv_source: KvSource, metrics: DecodeMetrics) -> None:
        self._engine = engine
        self._kv_source = kv_source
        self._metrics = metrics

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
        params, pulled = await self._prepare(request)
        ended = asyncio.get_running_loop().create_future()

        def emit(emission: Emission) -> None:
            if emission.error is not None:
                failure = engine_error(emission.error)
                stream.post(tag, emission.token_ids, code=failure.code, message=failure.message)
            else:
                stream.post(tag, emission.token_ids, emission.finish_reason or "")
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
            num_generated=request.num_generated + 1,
        )
        self._engine.submit(seq)
        try:
            await ended
        finally:
            seq.cancel()

    async def _prepare(self, request: decode_pb2.DecodeRequest) -> tuple[SamplingParams, PulledKv]:
        """Validates a request and pulls its KV; raises RpcError with the status to answer."""
        self._metrics.requests.inc()
        try:
            params = sampling_from_proto(request.sampling)
            if not params.is_greedy and params.seed is None:
                raise ValueError("sampling.seed must be set on decode requests that sample")
            if not request.HasField("kv_handle"):
                raise ValueError("kv_handle is required")
            _check_resumed(request, params)
        except ValueError as exc:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        needed = request.kv_handle.num_tokens + params.max_tokens - 1 - request.num_generated
        if not self._engine.fits_ever(needed):
            raise RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request needs {needed} KV positions, more than this decode's whole pool",
            )
        try:
            pulled = await self._kv_source.take(request.kv_handle)
        except RpcError as exc:
            logger.warning("request %s: %s", request.request_id, exc.message)
            raise
        return params, pulled


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
