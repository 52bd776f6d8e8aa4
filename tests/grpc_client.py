"""A small client of the public Gateway API for tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.v1 import gateway_pb2, gateway_pb2_grpc, sampling_pb2


@dataclass
class Result:
    chunks: list[gateway_pb2.GenerateResponse] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def finish_reason(self) -> str:
        return self.chunks[-1].finish_reason if self.chunks else ""


def make_request(
    prompt: str = "", prompt_token_ids: Sequence[int] = (), apply_chat_template: bool = False, **sampling: Any
) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=prompt,
        prompt_token_ids=list(prompt_token_ids),
        apply_chat_template=apply_chat_template,
        sampling=sampling_pb2.SamplingParams(**sampling),
    )


async def generate(address: str, request: gateway_pb2.GenerateRequest, timeout_s: float = 120.0) -> Result:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        result = Result()
        async for chunk in stub.Generate(request, timeout=timeout_s):
            result.chunks.append(chunk)
        return result


class Stream:
    """One streaming request through the gateway, run as a task: the tokens it got so far, how it
    ended (``error``) and when (``ended_at``, monotonic)."""

    def __init__(self, address: str, request: gateway_pb2.GenerateRequest, timeout_s: float = 120.0) -> None:
        self.tokens: list[int] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.ended_at = 0.0
        self.task = asyncio.ensure_future(self._run(address, request, timeout_s))

    async def _run(self, address: str, request: gateway_pb2.GenerateRequest, timeout_s: float) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                async for chunk in gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=timeout_s):
                    self.tokens.extend(chunk.token_ids)
            except grpc.aio.AioRpcError as exc:
                self.error = exc
        self.ended_at = time.monotonic()


async def generate_many(address: str, requests: Sequence[gateway_pb2.GenerateRequest]) -> list[Result]:
    return list(await asyncio.gather(*(generate(address, r) for r in requests)))


def run(address: str, request: gateway_pb2.GenerateRequest) -> Result:
    return asyncio.run(generate(address, request))


def expect_error(address: str, request: gateway_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    try:
        run(address, request)
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the request succeeded but an error was expected")
