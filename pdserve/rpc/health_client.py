"""Client of the standard ``grpc.health.v1.Health`` service, and the ``pdserve health`` command.

``check`` asks once and answers with a status name: the server's ``ServingStatus`` name
(``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN``, ``UNKNOWN``) when it answered, or the gRPC
status code name of the failed call (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``, ``NOT_FOUND``, ...)
when it did not. Only ``SERVING`` means healthy.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc.channel_security import PLAIN, ChannelSecurity
from pdserve.rpc.client_flags import add_tls_client_arguments, tls_from_args

SERVING = "SERVING"
DEFAULT_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 0.1
# The longest single Check call wait_serving makes, so that it polls a server that hangs.
MAX_CALL_TIMEOUT_S = 1.0


def _check_on(channel: Any, timeout_s: float, service: str) -> str:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as error:
        code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
        return str(code.name)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def check(
    address: str, timeout_s: float = DEFAULT_TIMEOUT_S, service: str = "", security: ChannelSecurity = PLAIN
) -> str:
    """One health check of ``service`` ("" is the whole server) at ``address`` (HOST:PORT);
    ``security``: plaintext or TLS (and a client certificate)."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    with security.channel(address) as channel:
        return _check_on(channel, timeout_s, service)


def poll_until_serving(
    address: str,
    timeout_s: float,
    service: str = "",
    poll_interval_s: float = POLL_INTERVAL_S,
    security: ChannelSecurity = PLAIN,
) -> str:
    """Polls ``address`` until it reports SERVING or ``timeout_s`` passes; returns the last status."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    deadline = time.monotonic() + timeout_s
    with security.channel(address) as channel:
        while True:
            remaining = deadline - time.monotonic()
            status = _check_on(channel, max(min(remaining, MAX_CALL_TIMEOUT_S), 0.01), service)
            remaining = deadline - time.monotonic()
            if status == SERVING or remaining <= 0:
                return status
            time.sleep(min(poll_interval_s, remaining))


def wait_serving(
    address: str,
    timeout_s: float,
    service: str = "",
    poll_interval_s: float = POLL_INTERVAL_S,
    security: ChannelSecurity = PLAIN,
) -> None:
    """Polls ``address`` until it reports SERVING; raises TimeoutError after ``timeout_s``."""
    status = poll_until_serving(address, timeout_s, service, poll_interval_s, security)
    if status != SERVING:
        raise TimeoutError(f"{address} is not SERVING after {timeout_s:g} s (last status: {status})")


def add_health_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve health ADDRESS``."""
    parser.add_argument("address", help="gRPC address of a pdserve service, HOST:PORT")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"bound on the check, or on the whole wait with --wait (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument(
        "--wait", action="store_true", help="poll until SERVING or --timeout-s passes instead of asking once"
    )
    add_tls_client_arguments(parser)


def run_health(args: argparse.Namespace) -> int:
    """Prints the status name; exit code 0 when SERVING, 1 otherwise (2 on bad arguments)."""
    address: str = args.address
    timeout_s: float = args.timeout_s
    service: str = args.service
    if timeout_s <= 0:
        print(f"error: --timeout-s must be > 0, got {timeout_s}", file=sys.stderr)
        return 2
    try:
        security = tls_from_args(args)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if getattr(args, "wait", False):
        status = poll_until_serving(address, timeout_s, service, security=security)
    else:
        status = check(address, timeout_s, service, security)
    print(status)
    return 0 if status == SERVING else 1
