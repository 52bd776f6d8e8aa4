"""What a public client is told when its request fails: the status code, a message of the gateway's
own, and the request id; never an internal address or a backend's exception text (those go to the
gateway's log, under the same request id).

Client errors (bad input, a request that does not fit, no such model) keep their message, which
names the field at fault, with any address in it masked. Every other failure says only what kind of
failure it was and, when tokens had reached the client, how many.
"""

from __future__ import annotations

import logging
import re

import grpc

from pdserve.rpc.errors import RpcError

logger = logging.getLogger(__name__)

CLIENT_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)
_SUMMARY = {
    grpc.StatusCode.UNAVAILABLE: "the service could not complete the request",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the request ran out of time",
    grpc.StatusCode.CANCELLED: "the request was cancelled",
    grpc.StatusCode.ABORTED: "the service could not complete the request",
}
# host:port (names, IPv4, bracketed IPv6), unix: paths, bare IPv4 addresses.
_ADDRESS = re.compile(
    r"(\[[0-9A-Fa-f:.%\w]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):\d{1,5}\b|unix:\S+|\b\d{1,3}(\.\d{1,3}){3}\b"
)
_DELIVERED = re.compile(r"\b(\d+) tokens? (?:was|were) delivered")
MAX_MESSAGE_CHARS = 1024


def public_error(exc: RpcError, request_id: str) -> RpcError:
    """The error to return to the client for ``exc``; the full one is logged with ``request_id``."""
    logger.warning("request %s failed: %s: %s", request_id, exc.code.name, exc.message)
    if exc.code in CLIENT_ERRORS:
        message = _ADDRESS.sub("<internal>", exc.message)[:MAX_MESSAGE_CHARS]
    else:
        message = _SUMMARY.get(exc.code, "internal error")
        delivered = _DELIVERED.search(exc.message)
        if delivered is not None:
            message += f" after {delivered.group(1)} tokens were delivered"
    return RpcError(exc.code, f"{message} (request id {request_id})")
