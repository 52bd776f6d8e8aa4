"""The gateway's connections to prefill and decode processes, and which one a request uses."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc

from pdserve.grpc_server import MAX_MESSAGE_BYTES
from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc

StubT = TypeVar("StubT")

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


@dataclass
class Backend(Generic[StubT]):
    address: str
    channel: grpc.aio.Channel
    stub: StubT
    outstanding: int = 0


class BackendPool(Generic[StubT]):
    """Picks the backend with the least outstanding requests (round robin among equals)."""

    def __init__(self, backends: Sequence[Backend[StubT]]) -> None:
        if not backends:
            raise ValueError("a backend pool needs at least one address")
        self._backends = list(backends)
        self._order = itertools.cycle(range(len(self._backends)))

    def pick(self) -> Backend[StubT]:
        start = next(self._order)
        rotated = self._backends[start:] + self._backends[:start]
        return min(rotated, key=lambda b: b.outstanding)

    async def close(self) -> None:
        for backend in self._backends:
            await backend.channel.close()


def prefill_pool(addresses: Sequence[str]) -> BackendPool[prefill_pb2_grpc.PrefillStub]:
    backends = []
    for address in addresses:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        backends.append(Backend(address, channel, prefill_pb2_grpc.PrefillStub(channel)))
    return BackendPool(backends)


def decode_pool(addresses: Sequence[str]) -> BackendPool[decode_pb2_grpc.DecodeStub]:
    backends = []
    for address in addresses:
        channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        backends.append(Backend(address, channel, decode_pb2_grpc.DecodeStub(channel)))
    return BackendPool(backends)
