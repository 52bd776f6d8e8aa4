"""gRPC servicer of the public pdserve.v1.Gateway: validation at the edge, then the request flow."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway.metrics import GatewayMetrics
from gateway.public_errors import public_error
from gateway.request_flow import RequestFlow
from pdserve.rpc.errors import RpcError, abort
from pdserve.rpc.sampling_proto import sampling_from_proto
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, flow: RequestFlow, metrics: GatewayMetrics) -> None:
        self._flow = flow
        self._metrics = metrics

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        self._metrics.requests.inc()
        self._metrics.in_flight.inc()
        if not request.request_id:  # the id a failure is logged under, and the client told
            request.request_id = secrets.token_hex(8)
        try:
            params = sampling_from_proto(request.sampling)
            async for response in self._flow.generate(request, params):
                self._metrics.generated_tokens.inc(len(response.token_ids))
                yield response
        except ValueError as exc:
            self._metrics.failed.labels(grpc.StatusCode.INVALID_ARGUMENT.name).inc()
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RpcError as exc:
            self._metrics.failed.labels(exc.code.name).inc()
            public = public_error(exc, request.request_id)
            await abort(context, public.code, public.message)
        except (asyncio.CancelledError, GeneratorExit):
            self._metrics.cancelled.inc()
            raise
        finally:
            self._metrics.in_flight.dec()
