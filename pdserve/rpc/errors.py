"""Errors as gRPC status codes: servicers abort with a code and a message, never a traceback."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc


class RpcError(Exception):
    """An error with the gRPC status a caller should see."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def abort(context: Any, code: grpc.StatusCode, message: str) -> NoReturn:
    """Ends the call with ``code`` (context.abort raises; this only tells the type checker so)."""
    await context.abort(code, message)
    raise RpcError(code, message)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The status code with the wire value ``value`` (UNKNOWN for values gRPC does not define)."""
    return _CODES.get(value, grpc.StatusCode.UNKNOWN)
