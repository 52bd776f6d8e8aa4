"""Errors of the HTTP API in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Bad input is 400 ``invalid_request_error`` (the gateway's ValueError and INVALID_ARGUMENT messages,
and body validation), an unknown model is 404 ``model_not_found``, an unreachable or failing
backend is 503, a request past its ``timeout`` is 504, an overloaded gateway or backend (RESOURCE_EXHAUSTED) is 429 with ``Retry-After``,
a body beyond ``--max-body-bytes`` is 413, anything else is 500. No response carries a traceback.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from gateway.openai_models import ErrorInfo, ErrorResponse
from pdserve.rpc.errors import RpcError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"

_BAD_INPUT_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
_UNAVAILABLE_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
)
RETRY_AFTER_S = 1  # a backend's RESOURCE_EXHAUSTED carries no wait of its own
# The gateway names the field first: "sampling.top_p must ...", "prompt_token_ids[3] = ...".
_FIELD = re.compile(r"^(?:sampling\.)?([a-z_]+)")
_KNOWN_PARAMS = frozenset(
    {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "prompt", "n"}
)


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type_, param=param, code=code)
        self.headers = headers or {}

    def model(self) -> ErrorResponse:
        return ErrorResponse(error=self.info)

    def body(self) -> dict[str, Any]:
        return self.model().model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, INVALID_REQUEST, param=param)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404, f"The model `{model}` does not exist.", INVALID_REQUEST, param="model", code="model_not_found"
    )


def from_value_error(exc: ValueError, param_names: dict[str, str] | None = None) -> OpenAIError:
    """400 for a gateway ValueError; ``param`` is the field its message names first."""
    message = str(exc)
    match = _FIELD.match(message)
    field = match.group(1) if match else None
    if field == "prompt_token_ids":
        field = "prompt"
    if field not in _KNOWN_PARAMS:
        field = None
    elif param_names:
        field = param_names.get(field, field)
    return bad_request(message, field)


def overloaded(message: str, retry_after_s: int) -> OpenAIError:
    """429: the gateway or every backend tried is full; try again after ``retry_after_s``."""
    return OpenAIError(
        429, message, "rate_limit_error", code="overloaded", headers={"Retry-After": str(retry_after_s)}
    )


def from_rpc_error(exc: RpcError) -> OpenAIError:
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return overloaded(exc.message, getattr(exc, "retry_after_s", RETRY_AFTER_S))
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return OpenAIError(504, exc.message, SERVER_ERROR, code="timeout")
    if exc.code in _BAD_INPUT_CODES:
        return from_value_error(ValueError(exc.message))
    if exc.code in _UNAVAILABLE_CODES:
        return OpenAIError(503, exc.message, SERVER_ERROR, code="service_unavailable")
    return OpenAIError(500, exc.message, SERVER_ERROR, code="internal_error")


def as_openai_error(exc: Exception, param_names: dict[str, str] | None = None) -> OpenAIError:
    """The OpenAI error of whatever a request raised."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, ValueError):
        return from_value_error(exc, param_names)
    if isinstance(exc, RpcError):
        return from_rpc_error(exc)
    logger.error("HTTP request failed", exc_info=exc)
    return OpenAIError(500, "internal error in the gateway", SERVER_ERROR, code="internal_error")


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    parts = []
    param = None
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        if error.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {error.get('msg', '')}", None
        parts.append(f"{where}: {error.get('msg', 'invalid')}" if where else str(error.get("msg")))
    return "; ".join(parts) or "invalid request body", param


def install_handlers(app: FastAPI) -> None:
    """Every error the app answers, in OpenAI's shape."""

    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        return as_openai_error(exc).response()

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        errors = exc.errors() if isinstance(exc, RequestValidationError) else []
        message, param = _validation_message(errors)
        return bad_request(message, param).response()

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
        type_ = INVALID_REQUEST if status < 500 else SERVER_ERROR
        return OpenAIError(status, str(detail), type_).response()

    async def on_any(request: Request, exc: Exception) -> JSONResponse:
        return as_openai_error(exc).response()

    for kind in (OpenAIError, ValueError, RpcError):
        app.add_exception_handler(kind, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_any)
