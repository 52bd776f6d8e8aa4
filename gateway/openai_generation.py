"""One request of the HTTP API through the request flow, rendered in OpenAI's shapes.

The first response is awaited before anything is sent, so that bad input and unavailable backends
get their HTTP status; after that a failure is one SSE ``error`` event. Every response that brings
tokens is a chunk, even when its text is held back (an incomplete character, a possible stop
string) and the chunk's text is empty, as vLLM streams them: the first token is a chunk when it is
sampled. Streams end with ``data: [DONE]``; with ``stream_options.include_usage`` the last chunk
before it has empty ``choices`` and the usage, as OpenAI sends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import cast

import grpc
from pydantic import BaseModel

from gateway.admission import Place
from gateway.metrics import GatewayMetrics
from gateway.openai_choices import Choices
from gateway.openai_errors import as_openai_error
from gateway.openai_models import (
    FinishReason,
    StopReason,
)
from gateway.openai_requests import openai_finish_reason
from gateway.public_errors import public_error
from gateway.request_flow import RequestFlow
from pdserve.core.sampling import SamplingParams
from pdserve.rpc.errors import RpcError
from pdserve.v1 import gateway_pb2, sampling_pb2

Responses = AsyncGenerator[gateway_pb2.GenerateResponse, None]
DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str, request_id: str | None = None) -> ResponseMeta:
        """``request_id``: the client's (vLLM's field), else a random one."""
        return cls(f"{prefix}-{request_id or secrets.token_hex(12)}", int(time.time()), model)


@dataclass
class Totals:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    finish_reason: FinishReason | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[sampling_pb2.TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[sampling_pb2.TokenLogprobs] = field(default_factory=list)
    stop_reason: StopReason = None

    def add(self, response: gateway_pb2.GenerateResponse) -> FinishReason | None:
        """Counts one response; its OpenAI finish reason, or None while the request goes on."""
        if response.num_prompt_tokens:
            self.prompt_tokens = response.num_prompt_tokens
            self.cached_tokens = response.num_cached_tokens
        self.completion_tokens += len(response.token_ids)
        self.text += response.text
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        self.prompt_logprobs.extend(response.prompt_logprobs)
        if response.finish_reason:
            self.finish_reason = openai_finish_reason(response.finish_reason)
            self.stop_reason = stop_reason(response)
        return self.finish_reason


async def observed(
    flow: RequestFlow,
    metrics: GatewayMetrics,
    place: Place,
    request: gateway_pb2.GenerateRequest,
    params: SamplingParams,
    deadline: float | None = None,
) -> Responses:
    """The flow's responses, counted in the gateway's metrics as the gRPC API counts them; the
    request's admission ``place`` is given back when they end."""
    metrics.requests.inc()
    metrics.in_flight.inc()
    try:
        generated = cast(Responses, flow.generate(request, params, deadline))
        async with contextlib.aclosing(generated) as responses:
            async for response in responses:
                metrics.generated_tokens.inc(len(response.token_ids))
                yield response
    except ValueError:
        metrics.failed.labels("INVALID_ARGUMENT").inc()
        raise
    except RpcError as exc:
        metrics.failed.labels(exc.code.name).inc()
        raise public_error(exc, request.request_id) from None
    except (asyncio.CancelledError, GeneratorExit):
        metrics.cancelled.inc()
        raise
    finally:
        place.release()
        metrics.in_flight.dec()


async def first_response(responses: Responses) -> gateway_pb2.GenerateResponse:
    """Raises the request's error (ValueError, RpcError) when it fails before its first token."""
    try:
        return await anext(responses)
    except StopAsyncIteration:
        raise RpcError(grpc.StatusCode.INTERNAL, "the request ended without a response") from None


async def chained(first: gateway_pb2.GenerateResponse, rest: Responses) -> Responses:
    yield first
    async for response in rest:
        yield response


RequestTotals = Choices[Totals]


async def collect(responses: Responses, per_prompt: int | None = None) -> RequestTotals:
    """A whole request's text and counts, by choice (its error when it fails); ``per_prompt``:
    the choices of each prompt of a batch (``gateway.prompt_batch``)."""
    totals = Choices(Totals, per_prompt)
    totals.add(await first_response(responses))
    async for response in responses:
        totals.add(response)
    return totals


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def event_stream(
    chunks: AsyncGenerator[BaseModel, None], rest: Responses, last: Callable[[], BaseModel | None]
) -> AsyncGenerator[str, None]:
    """``chunks`` as SSE events, then ``last()`` when it gives one (the usage chunk), then
    ``[DONE]``. A failure is one SSE ``error`` event; ``rest`` is closed however the stream ends."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield sse(chunk)
        final = last()
        if final is not None:
            yield sse(final)
    except Exception as exc:
        yield sse(as_openai_error(exc).model())
    finally:
        await rest.aclose()
    yield DONE


def stop_reason(response: gateway_pb2.GenerateResponse) -> StopReason:
    """The stop string or stop token id that ended the request (vLLM's ``stop_reason``), else None."""
    which = response.WhichOneof("stop_reason")
    if which == "stop_string":
        return response.stop_string
    if which == "stop_token_id":
        return response.stop_token_id
    return None
