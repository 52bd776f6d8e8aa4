"""gRPC servicer of the public pdserve.v1.Gateway: validation at the edge, then the request flow.

A request is checked against the input limits first (``gateway.input_limits``: INVALID_ARGUMENT),
then admitted under the in-flight bound (``gateway.admission``: RESOURCE_EXHAUSTED at once when
full); the client's gRPC deadline, when it set one, is the request's deadline down to the engines.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway.admission import Admission
from gateway.input_limits import InputLimits
from gateway.metrics import GatewayMetrics
from gateway.public_errors import public_error
from gateway.request_flow import RequestFlow
from pdserve.core.sampling import SamplingParams
from pdserve.rpc.errors import RpcError, abort
from pdserve.rpc.sampling_proto import sampling_from_proto
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc

logger = logging.getLogger(__name__)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        flow: RequestFlow,
        metrics: GatewayMetrics,
        inputs: InputLimits,
        admission: Admission,
        defaults: SamplingParams | None = None,
    ) -> None:
        """``defaults``: what unset optional sampling fields take (``gateway.generation_defaults``)."""
        self._defaults = defaults or SamplingParams()
        self._flow = flow
        self._metrics = metrics
        self._inputs = inputs
        self._admission = admission

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: Any
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        self._metrics.requests.inc()
        self._metrics.in_flight.inc()
        if not request.request_id:  # the id a failure is logged under, and the client told
            request.request_id = secrets.token_hex(8)
        try:
            self._inputs.check_generate(request)
            params = sampling_from_proto(request.sampling, self._defaults)
            with self._admission.enter():
                async for response in self._flow.generate(request, params, deadline_of(context)):
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


def deadline_of(context: Any) -> float | None:
    """The call's deadline as ``time.monotonic()`` seconds; None when the client set none."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining
