"""Graceful drain on SIGTERM, with real processes on 127.0.0.1 and work in flight.

Each service reports NOT_SERVING at once, refuses new work with UNAVAILABLE, finishes what it holds
within ``--grace-s`` and exits 0; a draining prefill still hands out the KV it parked before.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pdserve.rpc.health_client import check
from pdserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    gateway_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    sampling_pb2,
)
from tests.grpc_client import make_request
from tests.stack import ServiceProcess, Stack, internal_channel, scrape, wait_for

MODEL = "tiny-llama"
GRACE_S = 30.0
# About 3 ms a token on one CPU thread: streams of a few seconds.
LONG_TOKENS = 1200
LONGEST_TOKENS = 2000
GRACE_ARGS = ["--grace-s", str(GRACE_S)]
SHORT_GRACE_S = 1.0


class StreamInFlight(threading.Thread):
    """One server stream read on its own thread; ``started`` is set after a few tokens."""

    def __init__(self, open_stream: Callable[[grpc.Channel], Iterator[Any]], address: str) -> None:
        super().__init__(daemon=True)
        self._open_stream = open_stream
        self._address = address
        self.token_ids: list[int] = []
        self.finish_reason = ""
        self.error: grpc.RpcError | None = None
        self.ended_at = 0.0
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with internal_channel(self._address) as channel:
                for chunk in self._open_stream(channel):
                    self.token_ids.extend(chunk.token_ids)
                    self.finish_reason = chunk.finish_reason or self.finish_reason
                    if len(self.token_ids) >= 16:
                        self.started.set()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def wait_started(self) -> StreamInFlight:
        self.start()
        assert self.started.wait(60) and self.error is None, self.error
        return self


LONG = sampling_pb2.SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)
LONGEST = sampling_pb2.SamplingParams(max_tokens=LONGEST_TOKENS, temperature=0.0, ignore_eos=True)
SHORT = sampling_pb2.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def park(prefill: ServiceProcess, sampling: sampling_pb2.SamplingParams) -> prefill_pb2.PrefillResponse:
    """A Prefill call straight to the prefill: the KV stays parked until a decode pulls it."""
    with internal_channel(prefill.grpc) as channel:
        parked = prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_pb2.PrefillRequest(request_id="t", prompt_token_ids=[3, 1, 4, 1, 5], sampling=sampling)
        )
    assert parked.HasField("kv_handle")
    return parked


def decode_request(
    parked: prefill_pb2.PrefillResponse, sampling: sampling_pb2.SamplingParams
) -> decode_pb2.DecodeRequest:
    return decode_pb2.DecodeRequest(
        request_id="t", kv_handle=parked.kv_handle, first_token_id=parked.first_token_id, sampling=sampling
    )


def wait_not_serving(address: str, timeout_s: float = 2.0) -> float:
    """Seconds until ``address`` answers NOT_SERVING (it must answer, not just be unreachable)."""
    started = time.monotonic()
    statuses: list[str] = []

    def not_serving() -> bool:
        statuses.append(check(address, timeout_s=1.0))
        return statuses[-1] == "NOT_SERVING"

    assert wait_for(not_serving, timeout_s, interval_s=0.02), f"health answers were {statuses[-5:]}"
    return time.monotonic() - started


def exit_code(service: ServiceProcess, timeout_s: float) -> int:
    assert service.popen is not None
    return service.popen.wait(timeout_s)


def alive(services: list[ServiceProcess]) -> list[ServiceProcess]:
    return [s for s in services if s.popen is not None and s.popen.poll() is None]


@pytest.fixture(scope="module")
def stack(cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack for the module; each test drains one of its services. Of the three decodes, the
    last has a short grace period; the others let one survive the decode drain tests."""
    stack = Stack(
        MODEL,
        cache_dir,
        tmp_path_factory.mktemp("drain-logs"),
        num_decode=3,
        prefill_args=GRACE_ARGS,
        decode_args=GRACE_ARGS,
        gateway_args=GRACE_ARGS,
    )
    stack.decodes[2].args += ["--grace-s", str(SHORT_GRACE_S)]
    stack.start()
    yield stack
    stack.stop()


def assert_completed(stream: StreamInFlight, num_tokens: int) -> None:
    stream.join(GRACE_S + 30)
    assert stream.error is None, stream.error
    assert (len(stream.token_ids), stream.finish_reason) == (num_tokens, "length")


def parked_handles(prefill: ServiceProcess) -> float:
    return scrape(prefill.metrics)["pdserve_kv_parked_handles"]


def test_gateway_drain_finishes_the_stream_and_refuses_new_requests(stack: Stack) -> None:
    gateway = stack.gateway
    assert gateway is not None
    request = make_request(
        prompt_token_ids=[3, 1, 4, 1, 5], max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True
    )
    stream = StreamInFlight(
        lambda channel: gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=GRACE_S + 30),
        gateway.grpc,
    ).wait_started()
    gateway.signal(signal.SIGTERM)
    assert wait_not_serving(gateway.grpc) < 1.0
    assert stream.is_alive(), "the stream ended before the drain could be observed"

    with internal_channel(gateway.grpc) as channel, pytest.raises(grpc.RpcError) as refused:
        list(
            gateway_pb2_grpc.GatewayStub(channel).Generate(make_request(prompt_token_ids=[1, 2]), timeout=10)
        )
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (refused.value.details() or "")

    assert_completed(stream, LONG_TOKENS)
    assert exit_code(gateway, 10) == 0
    assert wait_for(lambda: parked_handles(stack.prefills[0]) == 0, 10)
    for decode in alive(stack.decodes):
        m = scrape(decode.metrics)
        assert m["pdserve_decode_running"] == 0 and m["pdserve_decode_waiting"] == 0


def test_decode_drain_finishes_the_stream_and_refuses_new_work(stack: Stack) -> None:
    prefill = stack.prefills[0]
    decode = alive(stack.decodes)[0]
    request = decode_request(park(prefill, LONG), LONG)
    stream = StreamInFlight(
        lambda channel: decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=GRACE_S + 30), decode.grpc
    ).wait_started()
    decode.signal(signal.SIGTERM)
    assert wait_not_serving(decode.grpc) < 1.0
    assert stream.is_alive(), "the stream ended before the drain could be observed"

    # New work is refused before any byte moves: the KV stays parked for another decode.
    parked = park(prefill, SHORT)
    with internal_channel(decode.grpc) as channel, pytest.raises(grpc.RpcError) as refused:
        list(decode_pb2_grpc.DecodeStub(channel).Decode(decode_request(parked, SHORT), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (refused.value.details() or "")
    other = next(d for d in alive(stack.decodes) if d is not decode)
    with internal_channel(other.grpc) as channel:
        chunks = list(decode_pb2_grpc.DecodeStub(channel).Decode(decode_request(parked, SHORT), timeout=30))
    assert sum(len(c.token_ids) for c in chunks) == SHORT.max_tokens - 1

    assert_completed(stream, LONG_TOKENS - 1)
    assert exit_code(decode, 10) == 0
    assert time.monotonic() - stream.ended_at < 10, "decode lingered after its last stream"
    assert parked_handles(prefill) == 0


def test_decode_hands_back_the_streams_still_running_when_its_grace_period_ends(stack: Stack) -> None:
    prefill = stack.prefills[0]
    decode = stack.decodes[2]
    request = decode_request(park(prefill, LONGEST), LONGEST)
    stream = StreamInFlight(
        lambda channel: decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=60), decode.grpc
    ).wait_started()
    decode.signal(signal.SIGTERM)
    signalled = time.monotonic()
    stream.join(60)
    assert stream.error is not None, "the stream finished within the grace period: make it longer"
    assert stream.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "grace period is over" in (stream.error.details() or "")
    assert len(stream.token_ids) < LONGEST_TOKENS - 1
    assert exit_code(decode, 15) == 0
    assert time.monotonic() - signalled < SHORT_GRACE_S + 6
    assert parked_handles(prefill) == 0


def test_prefill_drain_keeps_serving_the_kv_it_parked(stack: Stack) -> None:
    prefill = stack.prefills[0]
    decode = alive(stack.decodes)[0]
    parked = park(prefill, SHORT)
    prefill.signal(signal.SIGTERM)
    signalled = time.monotonic()
    assert wait_not_serving(prefill.grpc) < 1.0
    with pytest.raises(grpc.RpcError) as refused:
        park(prefill, SHORT)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    # The decode pulls the KV parked before the signal from the draining prefill.
    with internal_channel(decode.grpc) as channel:
        chunks = list(decode_pb2_grpc.DecodeStub(channel).Decode(decode_request(parked, SHORT), timeout=30))
    assert sum(len(c.token_ids) for c in chunks) == SHORT.max_tokens - 1
    assert chunks[-1].finish_reason == "length"

    # Nothing parked or sending any more: the prefill exits long before its grace period ends.
    assert exit_code(prefill, 15) == 0
    assert time.monotonic() - signalled < GRACE_S / 2
    m = scrape(decode.metrics)
    assert m["pdserve_decode_running"] == 0 and m["pdserve_decode_waiting"] == 0
