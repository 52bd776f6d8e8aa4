"""OpenAI-compatible HTTP API of the gateway, over the same request flow as the gRPC API.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed as server-sent events or
whole), ``GET /v1/models``, ``GET /v1/models/{id}`` (404 for another id), ``POST /tokenize``,
``POST /detokenize`` and ``GET /version`` (``gateway.tokenize_api``), ``GET /health`` and
``GET /metrics`` (the gateway's Prometheus registry, as on ``--metrics-port``). A completions
``prompt`` may be a batch, each prompt served as a request of its own (``gateway.prompt_batch``).
A client that disconnects cancels its
request, and with it decode; KV not yet pulled is released on the prefill. With an API key, calls
under ``/v1`` need it (``gateway.api_key``).

Every request is checked against the input limits before its prompt is tokenized or templated
(``gateway.input_limits``; 400), its body bounded (``gateway.body_limit``; 413), and it is admitted
under the gateway's in-flight bound (429 with ``Retry-After`` when full). A request may bound its
own time: the body field ``timeout`` or the header ``X-Request-Timeout``, in seconds; once they are
up the request ends (504 before its first token, an SSE ``error`` event after it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
import time
from collections.abc import AsyncGenerator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from gateway.admission import Admission, Place
from gateway.api_key import ApiKeyGate
from gateway.body_limit import BodyLimit
from gateway.chat_response import ChatForm, chat_completion, chat_events
from gateway.completion_response import CompletionForm, completion, completion_events
from gateway.http_responses import SseResponse, unless_disconnected
from gateway.input_limits import InputLimits
from gateway.metrics import GatewayMetrics
from gateway.openai_errors import (
    SERVER_ERROR,
    OpenAIError,
    bad_request,
    from_value_error,
    install_handlers,
    model_not_found,
)
from gateway.openai_generation import RequestTotals, ResponseMeta, Responses, collect, observed
from gateway.openai_logprobs import ChatShape, CompletionShape, TokenText, chat_counts, completion_counts
from gateway.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    ModelPermission,
    SamplingFields,
)
from gateway.openai_requests import (
    ChatPrompt,
    chat_max_tokens,
    check_supported,
    completion_inputs,
    completion_max_tokens,
    max_tokens_param,
    sampling_params,
)
from gateway.prompt_batch import batched, started
from gateway.prompt_input import PromptInput
from gateway.prompt_options import completion_prompt, truncated
from gateway.request_flow import RequestFlow
from gateway.tokenize_api import TokenizeApi
from gateway.tool_calls import tool_mode
from pdserve.core.limits import ModelLimits
from pdserve.core.sampling import SamplingParams
from pdserve.v1 import gateway_pb2

EventsFn = Callable[[ResponseMeta, gateway_pb2.GenerateResponse, Responses, bool], AsyncGenerator[str, None]]
BodyFn = Callable[[ResponseMeta, RequestTotals], BaseModel]
CLIENT_CLOSED = 499


class OpenAIApi:
    def __init__(
        self,
        flow: RequestFlow,
        metrics: GatewayMetrics,
        prompts: PromptInput,
        limits: ModelLimits,
        model_id: str,
        inputs: InputLimits,
        admission: Admission,
        api_key: str = "",
        defaults: SamplingParams | None = None,
        model_root: str = "",
    ) -> None:
        """``defaults``: the sampling defaults of fields a request omits (``gateway.generation_defaults``)."""
        self._flow = flow
        self._metrics = metrics
        self._prompts = prompts
        self._chat = ChatPrompt(prompts.tokenizer)
        self._inputs = inputs
        self._admission = admission
        self._limits = limits
        self._model_id = model_id
        self._api_key = api_key
        self._defaults = defaults or SamplingParams()
        self._model_root = model_root or model_id
        self._created = int(time.time())
        self._permission_id = f"modelperm-{secrets.token_hex(12)}"
        self._tokens = TokenizeApi(prompts, limits, inputs, model_id)
        self.draining = False

    def app(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
        install_handlers(app)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=None)
        app.add_api_route(
            "/v1/chat/completions", self.chat_completions, methods=["POST"], response_model=None
        )
        app.add_api_route("/v1/models", self.models, methods=["GET"], response_model=None)
        app.add_api_route("/v1/models/{model:path}", self.model, methods=["GET"], response_model=None)
        app.add_api_route("/tokenize", self._tokens.tokenize, methods=["POST"], response_model=None)
        app.add_api_route("/detokenize", self._tokens.detokenize, methods=["POST"], response_model=None)
        app.add_api_route("/version", self._tokens.version, methods=["GET"], response_model=None)
        app.add_api_route("/health", self.health, methods=["GET"], response_model=None)
        app.add_api_route("/metrics", self.metrics, methods=["GET"], response_model=None)
        if self._api_key:
            app.add_middleware(ApiKeyGate, key=self._api_key)
        app.add_middleware(BodyLimit, max_bytes=self._inputs.limits.max_body_bytes)
        return app

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self._admit(body)
        meta = ResponseMeta.new("cmpl", self._model_id, body.request_id)
        requests = completion_inputs(body, meta.id)
        try:
            self._inputs.check_prompt_count(len(requests))
            for request in requests:
                self._inputs.check_prompt(request)
            requests = [await completion_prompt(body, request, self._prompts) for request in requests]
            max_tokens = completion_max_tokens(body)
            echo_only = body.echo and max_tokens == 0  # the prompt alone (one token runs, unshown)
            params = sampling_params(body, 1 if echo_only else max_tokens, self._defaults)
        except ValueError as exc:
            raise from_value_error(exc) from exc
        logprobs, prompt_logprobs = completion_counts(
            body, self._limits.vocab_size, self._inputs.limits.max_logprobs
        )
        params = dataclasses.replace(params, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        places = self._admission.take_many(len(requests))  # before an echoed prompt is tokenized
        try:
            shapes: list[CompletionShape] = []
            if body.echo or logprobs is not None or prompt_logprobs is not None:
                for position, request in enumerate(requests):
                    shape, requests[position] = await self._completion_shape(body, request, params, echo_only)
                    shapes.append(shape)
            prompt_ids = None
            if body.return_token_ids:
                requests = [await self._as_token_ids(request) for request in requests]
                prompt_ids = [list(request.prompt_token_ids) for request in requests]
            form = CompletionForm(params.n, shapes, prompt_ids, echo_only, body.continuous_usage())
            events = functools.partial(completion_events, form=form)
            whole = functools.partial(completion, form=form)
            return await self._respond(raw, body, meta, requests, params, events, whole, places)
        except BaseException:
            release(places)  # a response that streams gives them back when its stream ends
            raise

    async def _completion_shape(
        self,
        body: CompletionRequest,
        request: gateway_pb2.GenerateRequest,
        params: SamplingParams,
        echo_only: bool,
    ) -> tuple[CompletionShape, gateway_pb2.GenerateRequest]:
        """How the request's choices show echo and logprobs; an echoed request's prompt goes on
        as token ids (its logprobs are per token)."""
        tokenizer = self._prompts.tokenizer
        text = TokenText(tokenizer, body.return_tokens_as_token_ids)
        shape = CompletionShape(text, params.logprobs, params.prompt_logprobs)
        if not body.echo:
            return shape, request
        if request.prompt:
            prompt_text = request.prompt
            ids = await self._prompts.off_loop(lambda: list(tokenizer(prompt_text).input_ids))
            request = gateway_pb2.GenerateRequest(request_id=request.request_id, prompt_token_ids=ids)
        else:
            ids = list(request.prompt_token_ids)
            try:
                self._limits.check_request(ids, params)
            except ValueError as exc:
                raise from_value_error(exc) from exc
            prompt_text = await self._prompts.off_loop(lambda: str(tokenizer.decode(ids)))
        return dataclasses.replace(
            shape, echo=True, echo_only=echo_only, prompt_text=prompt_text, prompt_ids=tuple(ids)
        ), request

    async def _as_token_ids(self, request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateRequest:
        """``request`` with its text prompt tokenized as the request flow would tokenize it."""
        if not request.prompt:
            return request
        text, tokenizer = request.prompt, self._prompts.tokenizer
        ids = await self._prompts.off_loop(lambda: list(tokenizer(text).input_ids))
        return gateway_pb2.GenerateRequest(request_id=request.request_id, prompt_token_ids=ids)

    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self._admit(body)
        tools = tool_mode(body)
        count, prompt_count = chat_counts(body, self._limits.vocab_size, self._inputs.limits.max_logprobs)
        shape = None
        if count is not None or prompt_count is not None:
            text = TokenText(self._prompts.tokenizer, body.return_tokens_as_token_ids)
            shape = ChatShape(text, count, prompt_count)
        meta = ResponseMeta.new("chatcmpl", self._model_id, body.request_id)
        try:
            self._inputs.check_texts("messages", [m.text() for m in body.messages])
        except ValueError as exc:
            raise from_value_error(exc) from exc
        places = self._admission.take_many(1)  # before templating: an overloaded gateway does none
        try:
            ids = await self._prompts.off_loop(
                lambda: self._chat.token_ids(body.messages, body, body.add_special_tokens)
            )
            ids = truncated(ids, body, self._limits.max_model_len)
            max_tokens = chat_max_tokens(body, len(ids), self._limits.max_model_len)
            params = sampling_params(body, max_tokens, self._defaults)
            params = dataclasses.replace(params, logprobs=count, prompt_logprobs=prompt_count)
            if tools is not None:
                if params.structured_output is not None:
                    raise bad_request(
                        "tool_choice constrains the output: give no other constraint", "tool_choice"
                    )
                params = dataclasses.replace(params, structured_output=tools.constraint)
            request = gateway_pb2.GenerateRequest(request_id=meta.id, prompt_token_ids=ids)
            form = ChatForm(shape, tools, ids if body.return_token_ids else None, body.continuous_usage())
            events = functools.partial(chat_events, form=form)
            whole = functools.partial(chat_completion, form=form)
            return await self._respond(raw, body, meta, [request], params, events, whole, places)
        except ValueError as exc:
            release(places)
            raise from_value_error(exc, {"prompt": "messages", **max_tokens_param(body)}) from exc
        except BaseException:
            release(places)  # a response that streams gives it back when its stream ends
            raise

    async def models(self) -> JSONResponse:
        return JSONResponse(ModelList(data=[self._card()]).model_dump())

    async def model(self, model: str) -> JSONResponse:
        if model != self._model_id:
            raise model_not_found(model)
        return JSONResponse(self._card().model_dump())

    async def health(self) -> Response:
        return Response(status_code=503 if self.draining else 200)

    async def metrics(self) -> Response:
        return Response(generate_latest(self._metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def _card(self) -> ModelCard:
        return ModelCard(
            id=self._model_id,
            created=self._created,
            root=self._model_root,
            max_model_len=self._limits.max_model_len,
            permission=[ModelPermission(id=self._permission_id, created=self._created)],
        )

    def _admit(self, body: SamplingFields) -> None:
        if self.draining:
            raise OpenAIError(503, "the gateway is shutting down", SERVER_ERROR, code="service_unavailable")
        if body.model is not None and body.model != self._model_id:
            raise model_not_found(body.model)
        check_supported(body)
        try:
            self._inputs.check_request_id(body.request_id or "")
            self._inputs.check_stop(stop_list(body.stop))
            self._inputs.check_bad_words(body.bad_words or [])
            self._inputs.check_stop_token_ids(len(body.stop_token_ids or ()))
            self._inputs.check_n(body.n)
        except ValueError as exc:
            raise from_value_error(exc) from exc

    async def _respond(
        self,
        raw: Request,
        body: SamplingFields,
        meta: ResponseMeta,
        requests: list[gateway_pb2.GenerateRequest],
        params: SamplingParams,
        events: EventsFn,
        whole: BodyFn,
        places: list[Place],
    ) -> Response:
        """The response to ``requests`` (one prompt each; a batch's as one), each holding its
        admission place until it ends."""
        deadline = request_deadline(body.timeout, raw.headers.get("x-request-timeout"))
        streams = [
            observed(self._flow, self._metrics, place, request, params, deadline)
            for request, place in zip(requests, places, strict=True)
        ]
        responses = batched(streams, params.n)
        if body.stream:
            first, rest = await started(responses, len(requests), params.n)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            # Every prompt's stream has started: each gives its place back when it ends.
            return SseResponse(events(meta, first, rest, include_usage))
        try:
            totals = await unless_disconnected(raw, collect(responses, params.n))
        finally:
            release(places)  # a prompt whose stream never started holds its place still
        if totals is None:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(whole(meta, totals).model_dump())


def release(places: list[Place]) -> None:
    for place in places:
        place.release()


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or ())


def request_deadline(field: float | None, header: str | None) -> float | None:
    """The ``time.monotonic()`` deadline of a request's ``timeout`` (the body field, else the
    ``X-Request-Timeout`` header, in seconds); None when it gives none."""
    timeout = field
    if timeout is None and header is not None:
        try:
            timeout = float(header)
        except ValueError:
            raise bad_request(f"X-Request-Timeout must be a number of seconds, got {header[:32]!r}") from None
    if timeout is None:
        return None
    if not (math.isfinite(timeout) and timeout > 0):
        raise bad_request(f"timeout must be a finite number of seconds > 0, got {timeout}", "timeout")
    return time.monotonic() + timeout
