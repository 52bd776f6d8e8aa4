"""KV handoff inside one process (prefill and decode colocated): the handle is taken out of the
prefill's registry and its buffer used in place. No transfer, no pair."""

from __future__ import annotations

import grpc

from decode_service.kv_source import PulledKv
from decode_service.metrics import DecodeMetrics
from pdserve.kv.handle import HandleCheck
from pdserve.kv.layout import KvLayout, unpack
from pdserve.rpc.errors import RpcError
from pdserve.v1 import kv_pb2
from prefill_service.kv_registry import KvRegistry
from prefill_service.metrics import PrefillMetrics


class LocalKvSource:
    def __init__(
        self,
        registry: KvRegistry,
        fingerprint: str,
        layout: KvLayout,
        metrics: DecodeMetrics,
        prefill_metrics: PrefillMetrics,
    ) -> None:
        self._registry = registry
        self._compatibility = HandleCheck(fingerprint, layout)
        self._layout = layout
        self._metrics = metrics
        self._prefill_metrics = prefill_metrics

    async def take(self, handle: kv_pb2.KvHandle) -> PulledKv:
        problem = self._compatibility.problem(handle)
        if problem is not None:
            self._metrics.kv_refused.inc()
            raise RpcError(grpc.StatusCode.FAILED_PRECONDITION, problem)
        entry = self._registry.take(handle.id)
        if entry is None:
            self._prefill_metrics.kv_pulls_not_found.inc()
            raise RpcError(grpc.StatusCode.NOT_FOUND, "KV handle is unknown, expired or already pulled")
        self._prefill_metrics.kv_pulls.inc()
        self._metrics.kv_pulls.inc()
        return PulledKv(unpack(entry.buffer, self._layout, entry.num_tokens), release=entry.free)

    async def close(self) -> None:
        return None
