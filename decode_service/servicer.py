"""gRPC servicer of pdserve.v1.Decode: pull the KV, join the engine, stream tokens back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from decode_service.engine import DecodeEngine, DecodeSequence
from decode_service.kv_source import KvSource
from decode_service.metrics import DecodeMetrics
from pdserve.engine_model import ForwardUnavailable
from pdserve.rpc_errors import RpcError, abort
from pdserve.sampling_proto import sampling_from_proto
from pdserve.v1 import decode_pb2, decode_pb2_grpc

logger = logging.getLogger(__name__)

_Item = tuple[list[int], str | None, BaseException | None]


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, engine: DecodeEngine, kv_source: KvSource, metrics: DecodeMetrics) -> None:
        self._engine = engine
        self._kv_source = kv_source
        self._metrics = metrics

    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: Any
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        self._metrics.requests.inc()
        try:
            params = sampling_from_proto(request.sampling)
            if not params.is_greedy and params.seed is None:
                raise ValueError("sampling.seed must be set on decode requests that sample")
            if not request.HasField("kv_handle"):
                raise ValueError("kv_handle is required")
        except ValueError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        needed = request.kv_handle.num_tokens + params.max_tokens - 1
        if not self._engine.fits_ever(needed):
            await abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request needs {needed} KV positions, more than this decode's whole pool",
            )
        try:
            kv = await self._kv_source.pull(request.kv_handle)
        except RpcError as exc:
            logger.warning("request %s: %s", request.request_id, exc.message)
            await abort(context, exc.code, exc.message)

        loop = asyncio.get_running_loop()
        items: asyncio.Queue[_Item] = asyncio.Queue()

        def emit(tokens: list[int], reason: str | None, error: BaseException | None) -> None:
            items.put_nowait((tokens, reason, error))

        seq = DecodeSequence(request.request_id, kv, request.first_token_id, params, emit, loop=loop)
        self._engine.submit(seq)
        try:
            while True:
                tokens, reason, error = await items.get()
                while reason is None and error is None and not items.empty():
                    more, reason, error = items.get_nowait()
                    tokens.extend(more)
                if error is not None:
                    code = (
                        grpc.StatusCode.UNAVAILABLE
                        if isinstance(error, ForwardUnavailable)
                        else grpc.StatusCode.INTERNAL
                    )
                    await abort(context, code, f"decode failed: {error}")
                yield decode_pb2.DecodeResponse(token_ids=tokens, finish_reason=reason or "")
                if reason is not None:
                    return
        finally:
            seq.cancel()
