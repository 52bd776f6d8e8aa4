"""Pulls that queue on one pair go together in one PullKvMany and one transfer, in order, each with
its own outcome.

Both sides in this process: the prefill's handoff servicer on a real gRPC server, its
sender, and a decode's KvPuller, over real gloo pairs on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from datetime import timedelta

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from decode_service.kv_puller import KvPuller
from decode_service.metrics import DecodeMetrics
from pdserve.kv.handle import HandleIssuer
from pdserve.kv.layout import KvLayout, pack
from pdserve.rpc.errors import RpcError
from pdserve.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc
from prefill_service.kv_registry import KvRegistry
from prefill_service.kv_sender import KvSender
from prefill_service.metrics import PrefillMetrics
from prefill_service.servicer import KvHandoffServicer

CPU = torch.device("cpu")
TIMEOUT = timedelta(seconds=10)
LAYOUT = KvLayout(keys=((2, 4),) * 3, values=((2, 3),) * 3, dtype=torch.float32)

Layers = list[tuple[torch.Tensor, torch.Tensor]]


class Handoff:
    """A prefill's handoff side serving on port 0, and one decode's puller."""

    async def start(self) -> Handoff:
        self.metrics = PrefillMetrics(CollectorRegistry())
        self.registry = KvRegistry(60.0)
        self.sender = KvSender("prefill-m", "gloo", CPU, "127.0.0.1", TIMEOUT, self.metrics, 60.0)
        self.server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServicer_to_server(
            KvHandoffServicer(self.registry, self.sender, self.metrics), self.server
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.template = HandleIssuer(
            prefill_address=f"127.0.0.1:{self.port}",
            prefill_instance_id="prefill-m",
            model_fingerprint="fp",
            layout=LAYOUT,
        )
        self.decode_metrics = DecodeMetrics(CollectorRegistry())
        self.puller = KvPuller(
            "decode-m", "fp", LAYOUT, "gloo", CPU, "127.0.0.1", TIMEOUT, self.decode_metrics
        )
        return self

    def park(self, num_tokens: int) -> tuple[kv_pb2.KvHandle, Layers]:
        layers = [
            (torch.randn(1, 2, num_tokens, 4), torch.randn(1, 2, num_tokens, 3))
            for _ in range(len(LAYOUT.keys))
        ]
        entry = self.registry.park(pack(layers, LAYOUT, 0, 0, num_tokens, CPU), num_tokens)
        handle = self.template.issue(entry)
        return handle, layers

    def unknown(self, like: kv_pb2.KvHandle) -> kv_pb2.KvHandle:
        handle = kv_pb2.KvHandle()
        handle.CopyFrom(like)
        handle.id = secrets.token_bytes(16)
        return handle

    def prefill_count(self, name: str) -> float:
        value = self.metrics.registry.get_sample_value(name)
        return 0.0 if value is None else value

    async def stop(self) -> None:
        await self.puller.close()
        self.sender.close()
        await self.server.stop(0)


async def _until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def _assert_received(received: Layers, layers: Layers) -> None:
    for (k, v), (rk, rv) in zip(layers, received, strict=True):
        assert torch.equal(rk, k[0]) and torch.equal(rv, v[0])


def test_a_burst_of_pulls_is_one_call_after_the_first_and_each_gets_its_own_kv() -> None:
    async def scenario() -> None:
        handoff = await Handoff().start()
        try:
            parked = [handoff.park(n) for n in (3, 17, 1, 40, 8, 25)]
            handles = [h for h, _ in parked]
            # Unknown handles between known ones: they fail alone, the others still arrive in order.
            burst = [
                handles[0],
                handles[1],
                handoff.unknown(handles[0]),
                *handles[2:4],
                handoff.unknown(handles[1]),
            ]
            burst += handles[4:]
            results = await asyncio.gather(*(handoff.puller.pull(h) for h in burst), return_exceptions=True)
            expected = [
                parked[0][1],
                parked[1][1],
                None,
                parked[2][1],
                parked[3][1],
                None,
                parked[4][1],
                parked[5][1],
            ]
            for got, want in zip(results, expected, strict=True):
                if want is None:
                    assert isinstance(got, RpcError) and got.code == grpc.StatusCode.NOT_FOUND, got
                else:
                    assert not isinstance(got, BaseException), got
                    _assert_received(got, want)
            # The first pull found the pair free and went alone; the other seven queued behind it.
            assert handoff.prefill_count("pdserve_kv_pull_calls_total") == 2
            assert handoff.prefill_count("pdserve_kv_pulls_total") == 6
            assert handoff.prefill_count("pdserve_kv_pulls_not_found_total") == 2
            assert handoff.registry.num_parked == 0
            await _until(lambda: handoff.sender.num_in_flight == 0 and handoff.puller.num_receiving == 0)
            # One transfer per call: the five KVs the PullKvMany found went as one buffer.
            assert handoff.prefill_count("pdserve_kv_send_seconds_count") == 2
            # The pair stayed in step: single and batched pulls go on over it.
            handle, layers = handoff.park(5)
            _assert_received(await handoff.puller.pull(handle), layers)
            again = [handoff.park(n) for n in (2, 9, 4)]
            results = await asyncio.gather(*(handoff.puller.pull(h) for h, _ in again))
            for got, (_, want) in zip(results, again, strict=True):
                _assert_received(got, want)
            assert handoff.sender.num_pairs == 1
            await _until(lambda: handoff.sender.num_in_flight == 0)
            assert handoff.prefill_count("pdserve_kv_send_seconds_count") == 5
        finally:
            await handoff.stop()

    asyncio.run(scenario())


def test_pull_kv_many_checks_its_request() -> None:
    async def scenario() -> None:
        handoff = await Handoff().start()
        try:
            handle, _ = handoff.park(4)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{handoff.port}") as channel:
                stub = prefill_pb2_grpc.PrefillStub(channel)
                bad = [
                    prefill_pb2.PullKvManyRequest(decode_instance_id="d", pair_generation=1),
                    prefill_pb2.PullKvManyRequest(
                        handle_ids=[handle.id, b"short"], decode_instance_id="d", pair_generation=1
                    ),
                    prefill_pb2.PullKvManyRequest(handle_ids=[handle.id], pair_generation=1),
                    prefill_pb2.PullKvManyRequest(handle_ids=[handle.id], decode_instance_id="d"),
                ]
                for request in bad:
                    with pytest.raises(grpc.aio.AioRpcError) as failure:
                        await stub.PullKvMany(request, timeout=10)
                    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert handoff.registry.num_parked == 1  # a refused call takes nothing
        finally:
            await handoff.stop()

    asyncio.run(scenario())
