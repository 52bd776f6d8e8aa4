"""Rank 0's public servicers of an expert-parallel service: each call is handed to one rank.

Every rank serves the real Prefill/Decode servicers on an internal gRPC server; rank 0's public
server carries these routers instead:
- Prefill goes to the rank with the fewest calls in flight (attention is data-parallel: each rank
  prefills its own requests and parks their KV; the handle names that rank and its address, so a
  decode pulls from it directly);
- ReleaseKv goes to every rank (the one holding the handle releases it);
- each request of a DecodeMany call goes to the rank with the fewest streams in flight, or, when a
  decode takes the KV in memory (colocated), to the rank named in the handle; its answers come
  back as that call's updates. A Decode call is relayed as a DecodeMany call of one request.
Status codes and messages of a rank's answer reach the caller unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from pdserve.rpc.channel_security import ChannelSecurity
from pdserve.rpc.errors import RpcError, abort
from pdserve.rpc.server import MESSAGE_SIZE_OPTIONS
from pdserve.rpc.update_stream import UpdateStream, serve_many, serve_one
from pdserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


class RankChannels:
    """One channel per rank's internal server (``security``: the internal credential), and the calls
    in flight on each."""

    def __init__(self, addresses: Sequence[str], security: ChannelSecurity) -> None:
        self.channels = [security.aio_channel(a, options=MESSAGE_SIZE_OPTIONS) for a in addresses]
        self.in_flight = [0] * len(addresses)

    def least_loaded(self) -> int:
        return min(range(len(self.in_flight)), key=lambda r: (self.in_flight[r], r))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.channels))


class PrefillRouter(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, ranks: RankChannels) -> None:
        self._ranks = ranks
        self._stubs = [prefill_pb2_grpc.PrefillStub(c) for c in ranks.channels]

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: Any) -> prefill_pb2.PrefillResponse:
        rank = self._ranks.least_loaded()
        self._ranks.in_flight[rank] += 1
        try:
            response: prefill_pb2.PrefillResponse = await self._stubs[rank].Prefill(
                request, timeout=context.time_remaining()
            )
            return response
        except grpc.aio.AioRpcError as exc:
            await abort(context, exc.code(), exc.details() or "")
        finally:
            self._ranks.in_flight[rank] -= 1

    async def ReleaseKv(
        self, request: prefill_pb2.ReleaseKvRequest, context: Any
    ) -> prefill_pb2.ReleaseKvResponse:
        answers = await asyncio.gather(
            *(stub.ReleaseKv(request, timeout=context.time_remaining()) for stub in self._stubs),
            return_exceptions=True,
        )
        released = any(isinstance(a, prefill_pb2.ReleaseKvResponse) and a.released for a in answers)
        return prefill_pb2.ReleaseKvResponse(released=released)

    async def PullKv(self, request: prefill_pb2.PullKvRequest, context: Any) -> prefill_pb2.PullKvResponse:
        await abort(
            context,
            grpc.StatusCode.FAILED_PRECONDITION,
            "PullKv goes to the prefill_address of the KV handle (the rank holding the KV), not here",
        )

    async def PullKvMany(
        self, request: prefill_pb2.PullKvManyRequest, context: Any
    ) -> prefill_pb2.PullKvManyResponse:
        await abort(
            context,
            grpc.StatusCode.FAILED_PRECONDITION,
            "PullKvMany goes to the prefill_address of the KV handles (the rank holding the KV), not here",
        )


class DecodeRouter(decode_pb2_grpc.DecodeServicer):
    def __init__(self, ranks: RankChannels, by_handle_rank: bool) -> None:
        self._ranks = ranks
        self._stubs = [decode_pb2_grpc.DecodeStub(c) for c in ranks.channels]
        self._by_handle_rank = by_handle_rank

    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: Any
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        relay = functools.partial(self._relay, timeout=context.time_remaining())
        async for response in serve_one(request, relay, context):
            yield response

    async def DecodeMany(
        self, request_iterator: AsyncIterator[decode_pb2.DecodeManyRequest], context: Any
    ) -> AsyncIterator[decode_pb2.DecodeManyResponse]:
        async for response in serve_many(request_iterator, self._relay):
            yield response

    async def _relay(
        self,
        tag: int,
        request: decode_pb2.DecodeRequest,
        stream: UpdateStream,
        timeout: float | None = None,
    ) -> None:
        """One request of a call, decoded by its rank; ``timeout``: the deadline the rank gets."""
        rank = self._rank_for(request)
        self._ranks.in_flight[rank] += 1
        call = self._stubs[rank].Decode(request, timeout=timeout)
        try:
            async for response in call:
                stream.post(tag, response.token_ids, response.finish_reason)
        except grpc.aio.AioRpcError as exc:
            raise RpcError(exc.code(), exc.details() or "") from None
        finally:
            self._ranks.in_flight[rank] -= 1
            with contextlib.suppress(Exception):
                call.cancel()

    def _rank_for(self, request: decode_pb2.DecodeRequest) -> int:
        if not self._by_handle_rank:
            return self._ranks.least_loaded()
        rank = request.kv_handle.rank
        if rank >= len(self._stubs):
            raise RpcError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"kv_handle.rank {rank} is not a rank of this service ({len(self._stubs)} ranks)",
            )
        return rank
