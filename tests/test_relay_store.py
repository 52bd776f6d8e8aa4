"""The decode's end of a pair store against a prefill that stopped answering: every operation fails
within the pair's timeout (plus a small margin for a wait the prefill would have answered itself),
so a prefill stopped while a pair is being built cannot stretch the pull's bound."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from datetime import timedelta
from typing import Any

import grpc
import pytest

from pdserve.kv.relay_store import ANSWER_MARGIN_S, RelayStore
from pdserve.v1 import prefill_pb2, prefill_pb2_grpc

TIMEOUT = timedelta(seconds=1)


class _Stopped(prefill_pb2_grpc.PrefillServicer):
    """Takes every PairStore call and never answers it (a SIGSTOPped prefill)."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()

    def PairStore(self, request: prefill_pb2.PairStoreRequest, context: Any) -> prefill_pb2.PairStoreResponse:
        self.calls += 1
        self.release.wait(30)
        return prefill_pb2.PairStoreResponse()


@pytest.fixture
def stopped() -> Iterator[tuple[_Stopped, RelayStore]]:
    servicer = _Stopped()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, RelayStore(prefill_pb2_grpc.PrefillStub(channel), "d" * 32, b"s" * 32, 1, TIMEOUT)
    finally:
        servicer.release.set()
        channel.close()
        server.stop(0)


@pytest.mark.parametrize(
    ("op", "bound_s"),
    [
        ("set", TIMEOUT.total_seconds()),
        ("add", TIMEOUT.total_seconds()),
        ("check", TIMEOUT.total_seconds()),
        ("wait", TIMEOUT.total_seconds() + ANSWER_MARGIN_S),
        ("get", TIMEOUT.total_seconds() + ANSWER_MARGIN_S),
    ],
)
def test_every_operation_on_a_prefill_that_never_answers_fails_within_the_pair_timeout(
    stopped: tuple[_Stopped, RelayStore], op: str, bound_s: float
) -> None:
    servicer, store = stopped
    calls = {
        "set": lambda: store.set("k", b"v"),
        "add": lambda: store.add("k", 1),
        "check": lambda: store.check(["k"]),
        "wait": lambda: store.wait(["k"]),
        "get": lambda: store.get("k"),
    }
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"pair store {op} failed: DEADLINE_EXCEEDED"):
        calls[op]()
    elapsed = time.monotonic() - started
    assert servicer.calls == 1
    assert bound_s - 0.1 <= elapsed < bound_s + 0.5, elapsed
