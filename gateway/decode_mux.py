"""The gateway's DecodeMany calls: the requests it sends one decode share one call.

A ``DecodeMux`` belongs to one decode backend. A request's ``start`` opens a DecodeMany call when
none is open, gives the request a tag and sends it; each response of the call (one per decode step)
is split into its requests' updates. When a request ends the gateway ``close``s it: a request that
had not finished is cancelled on the decode. The mux closes its side of the call once the call's
last request has ended, so an idle gateway holds no call and a draining decode sees its work end;
the next request opens a new call.

A call that fails ends every request still on it with the call's status: the decode died or
restarted (UNAVAILABLE, CANCELLED, ...), or the backend's health probe says it is down, in which
case the call is cancelled at once so that no request waits on a wedged process.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from gateway.backend_health import BackendHealth
from pdserve.v1 import decode_pb2, decode_pb2_grpc


class DecodeFailure(Exception):
    """A request's call failed; ``backend_down``: because the backend's health probe says it is down;
    ``local``: because the gateway cancelled it (shutting down), not the backend."""

    def __init__(
        self, code: grpc.StatusCode, details: str, backend_down: bool = False, local: bool = False
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.backend_down = backend_down
        self.local = local


@dataclass(eq=False)
class _Call:
    outgoing: asyncio.Queue[decode_pb2.DecodeManyRequest | None]
    call: grpc.aio.StreamStreamCall
    tags: set[int] = field(default_factory=set)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    half_closed: bool = False


class MuxedRequest:
    """One request on a mux: its updates in order, then ``close``."""

    def __init__(self, mux: DecodeMux, tag: int) -> None:
        self._mux = mux
        self.tag = tag
        self.items: asyncio.Queue[decode_pb2.DecodeUpdate | DecodeFailure] = asyncio.Queue()
        self._ended = False

    async def next(self) -> decode_pb2.DecodeUpdate:
        """The next update; raises DecodeFailure when the call failed."""
        item = await self.items.get()
        if isinstance(item, DecodeFailure):
            self._ended = True
            raise item
        if item.finish_reason or item.error_code:
            self._ended = True
        return item

    def close(self) -> None:
        """Ends the request here; one still running on the decode is cancelled there."""
        self._mux.end(self.tag, cancel=not self._ended)
        self._ended = True


class DecodeMux:
    def __init__(self, stub: decode_pb2_grpc.DecodeStub, health: BackendHealth) -> None:
        self._stub = stub
        self._health = health
        self._tags = itertools.count(1)
        self._requests: dict[int, tuple[MuxedRequest, _Call]] = {}
        self._current: _Call | None = None
        self._calls: set[_Call] = set()  # open, or half-closed and still answering

    def start(self, request: decode_pb2.DecodeRequest) -> MuxedRequest:
        call = self._current or self._open()
        tag = next(self._tags)
        muxed = MuxedRequest(self, tag)
        self._requests[tag] = (muxed, call)
        call.tags.add(tag)
        call.outgoing.put_nowait(decode_pb2.DecodeManyRequest(tag=tag, start=request))
        return muxed

    def end(self, tag: int, cancel: bool) -> None:
        entry = self._requests.pop(tag, None)
        if entry is None:
            return
        call = entry[1]
        call.tags.discard(tag)
        if cancel and not call.half_closed:
            call.outgoing.put_nowait(decode_pb2.DecodeManyRequest(tag=tag, cancel=True))
        if not call.tags and call is self._current:
            self._current = None
            call.half_closed = True
            call.outgoing.put_nowait(None)

    async def close(self) -> None:
        """Cancels every call (gateway shutdown): their requests fail with CANCELLED."""
        self._current = None
        calls = list(self._calls)
        for call in calls:
            call.call.cancel()
        await asyncio.gather(*(task for call in calls for task in call.tasks), return_exceptions=True)

    def _open(self) -> _Call:
        outgoing: asyncio.Queue[decode_pb2.DecodeManyRequest | None] = asyncio.Queue()
        call = _Call(outgoing, self._stub.DecodeMany(_drain(outgoing)))
        loop = asyncio.get_running_loop()
        call.tasks = [loop.create_task(self._read(call)), loop.create_task(self._watch(call))]
        self._current = call
        self._calls.add(call)
        return call

    async def _read(self, call: _Call) -> None:
        try:
            async for response in call.call:
                for update in response.updates:
                    entry = self._requests.get(update.tag)
                    if entry is not None and entry[1] is call:
                        entry[0].items.put_nowait(update)
            failure = DecodeFailure(
                grpc.StatusCode.INTERNAL, "the decode ended the call with requests running"
            )
        except grpc.aio.AioRpcError as exc:
            failure = DecodeFailure(exc.code(), exc.details() or "")
        except asyncio.CancelledError:
            failure = DecodeFailure(grpc.StatusCode.CANCELLED, "the gateway is shutting down", local=True)
        self._fail(call, failure)
        self._calls.discard(call)
        for task in call.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    async def _watch(self, call: _Call) -> None:
        await self._health.down.wait()
        self._fail(
            call, DecodeFailure(grpc.StatusCode.UNAVAILABLE, f"backend is down ({self._health.reason})", True)
        )
        call.call.cancel()

    def _fail(self, call: _Call, failure: DecodeFailure) -> None:
        """Ends every request still on ``call`` with ``failure`` (once: the first failure wins)."""
        if call is self._current:
            self._current = None
        if not call.half_closed:  # lets the request stream end instead of waiting for more
            call.half_closed = True
            call.outgoing.put_nowait(None)
        for tag in list(call.tags):
            entry = self._requests.pop(tag, None)
            if entry is not None:
                entry[0].items.put_nowait(failure)
        call.tags.clear()


async def _drain(
    outgoing: asyncio.Queue[decode_pb2.DecodeManyRequest | None],
) -> AsyncIterator[decode_pb2.DecodeManyRequest]:
    while (message := await outgoing.get()) is not None:
        yield message
