"""gRPC servicer of pdserve.v1.Prefill: converts at the edge, delegates to engine and registry."""

from __future__ import annotations

import logging
from typing import Any

import grpc

from pdserve.engine_model import EngineModel
from pdserve.rpc_errors import abort
from pdserve.sampling_proto import sampling_from_proto
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc
from prefill_service.engine import PrefillEngine
from prefill_service.kv_registry import HANDLE_ID_BYTES, KvRegistry, ParkedKv
from prefill_service.kv_sender import KvSender
from prefill_service.metrics import PrefillMetrics

logger = logging.getLogger(__name__)

KV_HANDLE_VERSION = 1


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self,
        engine_model: EngineModel,
        engine: PrefillEngine,
        registry: KvRegistry,
        sender: KvSender,
        metrics: PrefillMetrics,
        handle_template: kv_pb2.KvHandle,
    ) -> None:
        self._m = engine_model
        self._engine = engine
        self._registry = registry
        self._sender = sender
        self._metrics = metrics
        self._handle_template = handle_template

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:
        try:
            params = sampling_from_proto(request.sampling)
            self._m.limits.check_request(request.prompt_token_ids, params)
            if not params.is_greedy and params.seed is None:
                raise ValueError("sampling.seed must be set on prefill requests that sample")
        except ValueError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._metrics.requests.inc()
        self._metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        result = await self._engine.run(request.prompt_token_ids, params)
        self._metrics.forward_seconds.observe(result.forward_seconds)
        if result.finish_reason is not None or result.kv_buffer is None:
            self._metrics.finished_at_first_token.labels(result.finish_reason or "").inc()
            return prefill_pb2.PrefillResponse(
                first_token_id=result.first_token_id, finish_reason=result.finish_reason or ""
            )
        entry = self._registry.park(result.kv_buffer, result.num_tokens)
        self._metrics.kv_parks.inc()
        logger.debug("request %s parked %d bytes", request.request_id, entry.num_bytes)
        return prefill_pb2.PrefillResponse(
            first_token_id=result.first_token_id, kv_handle=self._handle(entry)
        )

    async def PullKv(self, request: prefill_pb2.PullKvRequest, context: Any) -> prefill_pb2.PullKvResponse:
        if len(request.handle_id) != HANDLE_ID_BYTES:
            await abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"handle_id must be {HANDLE_ID_BYTES} bytes"
            )
        if not request.decode_instance_id or request.pair_generation == 0:
            await abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "decode_instance_id and pair_generation must be set",
            )
        entry = self._registry.take(request.handle_id)
        if entry is None:
            self._metrics.kv_pulls_not_found.inc()
            await abort(context, grpc.StatusCode.NOT_FOUND, "KV handle is unknown, expired or already pulled")
        self._metrics.kv_pulls.inc()
        self._sender.send(entry, request.decode_instance_id, request.pair_generation)
        return prefill_pb2.PullKvResponse(num_bytes=entry.num_bytes)

    async def ReleaseKv(
        self, request: prefill_pb2.ReleaseKvRequest, context: Any
    ) -> prefill_pb2.ReleaseKvResponse:
        released = self._registry.release(request.handle_id)
        if released:
            self._metrics.kv_releases.inc()
        return prefill_pb2.ReleaseKvResponse(released=released)

    def _handle(self, entry: ParkedKv) -> kv_pb2.KvHandle:
        handle = kv_pb2.KvHandle()
        handle.CopyFrom(self._handle_template)
        handle.version = KV_HANDLE_VERSION
        handle.id = entry.handle_id
        handle.num_tokens = entry.num_tokens
        handle.num_bytes = entry.num_bytes
        handle.expires_at_unix = entry.expires_at_unix
        handle.tensors.extend(spec.to_proto() for spec in self._m.kv_layout.tensor_specs(entry.num_tokens))
        return handle
