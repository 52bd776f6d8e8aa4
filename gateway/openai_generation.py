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
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import cast

import grpc
from pydantic import BaseModel

from gateway.admission import Place
from gateway.metrics import GatewayMetrics
from gateway.openai_choices import Choices
from gateway.openai_errors import as_openai_error
from gateway.openai_logprobs import ChatShape, CompletionShape
from gateway.openai_models import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    Delta,
    FinishReason,
    StopReason,
)
from gateway.openai_requests import openai_finish_reason
from gateway.public_errors import public_error
from gateway.request_flow import RequestFlow
from gateway.tool_calls import ToolCallStream, ToolMode
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


async def _chain(first: gateway_pb2.GenerateResponse, rest: Responses) -> Responses:
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


def completion(
    meta: ResponseMeta, totals: RequestTotals, shapes: Sequence[CompletionShape] = (), per_prompt: int = 1
) -> Completion:
    """``shapes``: each prompt's (none: the text alone), prompt ``p`` holding the choices
    ``p * per_prompt`` onward."""
    choices = []
    for index, totals_i in totals.by_index():
        shape = shapes[index // per_prompt] if shapes else None
        choice = CompletionChoice(
            index=index,
            text=totals_i.text,
            finish_reason=totals_i.finish_reason or "stop",
            stop_reason=totals_i.stop_reason,
        )
        if shape is not None:
            choice.text, choice.logprobs = shape.render(
                totals_i.text, totals_i.token_ids, totals_i.logprobs, totals_i.prompt_logprobs, first=True
            )
            choice.prompt_logprobs = shape.prompt_field(totals_i.prompt_logprobs)
        choices.append(choice)
    return Completion(
        id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=totals.usage()
    )


def chat_completion(
    meta: ResponseMeta, totals: RequestTotals, shape: ChatShape | None = None, tools: ToolMode | None = None
) -> ChatCompletion:
    """``tools``: the request's tool calling (``gateway.tool_calls``), each choice's output its calls."""
    choices = []
    prompt_logprobs: list[sampling_pb2.TokenLogprobs] = []
    for index, totals_i in totals.by_index():
        reason = totals_i.finish_reason or "stop"
        message = AssistantMessage(content=totals_i.text)
        if tools is not None:
            calls = tools.calls(totals_i.text)
            if calls is not None:
                message = AssistantMessage(content="", tool_calls=calls)
            reason = tools.finish(reason, calls)
        choice = ChatChoice(
            index=index, message=message, finish_reason=reason, stop_reason=totals_i.stop_reason
        )
        if shape is not None:
            choice.logprobs = shape.render(totals_i.token_ids, totals_i.logprobs)
        prompt_logprobs = prompt_logprobs or totals_i.prompt_logprobs
        choices.append(choice)
    body = ChatCompletion(
        id=meta.id, created=meta.created, model=meta.model, choices=choices, usage=totals.usage()
    )
    if shape is not None:
        body.prompt_logprobs = shape.prompt_field(prompt_logprobs)
    return body


def sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


async def completion_events(
    meta: ResponseMeta,
    first: gateway_pb2.GenerateResponse,
    rest: Responses,
    include_usage: bool,
    shapes: Sequence[CompletionShape] = (),
    per_prompt: int = 1,
) -> AsyncGenerator[str, None]:
    """The SSE events of a completion (``shapes`` and ``per_prompt`` as ``completion``'s)."""
    totals = Choices(Totals, per_prompt)
    try:
        async for response in _chain(first, rest):
            shape = shapes[response.index // per_prompt] if shapes else None
            is_first = totals.is_new(response.index)
            offset = len(totals.choice(response.index).text)
            reason = totals.add(response)
            choice = CompletionChoice(
                index=response.index,
                text=response.text,
                finish_reason=reason,
                stop_reason=totals.choice(response.index).stop_reason,
            )
            if shape is not None:
                choice.text, choice.logprobs = shape.render(
                    response.text,
                    response.token_ids,
                    response.logprobs,
                    response.prompt_logprobs,
                    first=is_first,
                    offset=offset,
                )
            if choice.text or reason is not None or response.token_ids:
                yield sse(Completion(id=meta.id, created=meta.created, model=meta.model, choices=[choice]))
        if include_usage:
            yield sse(
                Completion(
                    id=meta.id, created=meta.created, model=meta.model, choices=[], usage=totals.usage()
                )
            )
    except Exception as exc:
        yield sse(as_openai_error(exc).model())
    finally:
        await rest.aclose()
    yield DONE


async def chat_events(
    meta: ResponseMeta,
    first: gateway_pb2.GenerateResponse,
    rest: Responses,
    include_usage: bool,
    shape: ChatShape | None = None,
    tools: ToolMode | None = None,
) -> AsyncGenerator[str, None]:
    """The SSE events of a chat completion (``tools`` as ``chat_completion``'s)."""

    def chunk(
        index: int, delta: Delta, reason: FinishReason | None = None, logprobs: ChatLogprobs | None = None
    ) -> str:
        stop = totals.choice(index).stop_reason if reason is not None else None
        choice = ChatChunkChoice(
            index=index, delta=delta, finish_reason=reason, logprobs=logprobs, stop_reason=stop
        )
        return sse(ChatCompletionChunk(id=meta.id, created=meta.created, model=meta.model, choices=[choice]))

    totals = Choices(Totals)
    calls = ToolCallStream(tools) if tools is not None else None
    try:
        async for response in _chain(first, rest):
            if totals.is_new(response.index):  # a choice's first chunk gives the role
                yield chunk(response.index, Delta(role="assistant", content=""))
            reason = totals.add(response)
            logprobs = None
            if shape is not None and shape.top_logprobs is not None and response.token_ids:
                logprobs = shape.render(response.token_ids, response.logprobs)
            if calls is not None:
                brings = response.text or response.token_ids
                part = calls.part(response.index, response.text) if brings else None
                if part is not None:
                    yield chunk(response.index, Delta(tool_calls=part), logprobs=logprobs)
                if reason is not None:
                    text = totals.choice(response.index).text
                    whole, made = calls.whole(text)
                    if whole is not None:
                        yield chunk(response.index, Delta(tool_calls=whole))
                    elif calls.mode.required and text:
                        yield chunk(response.index, Delta(content=text))  # not calls: cut short
                    yield chunk(response.index, Delta(), calls.mode.finish(reason, made))
                continue
            if logprobs is not None or response.text or response.token_ids:
                yield chunk(response.index, Delta(content=response.text), logprobs=logprobs)
            if reason is not None:
                yield chunk(response.index, Delta(), reason)
        if include_usage:
            yield sse(
                ChatCompletionChunk(
                    id=meta.id, created=meta.created, model=meta.model, choices=[], usage=totals.usage()
                )
            )
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
