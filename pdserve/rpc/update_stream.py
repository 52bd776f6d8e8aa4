"""The serving side of one DecodeMany call: its requests' updates, gathered into few messages.

Producers ``post`` updates as they come (a decode step posts one per running request of the call,
all from one event-loop callback); ``responses`` sends whatever has gathered each time it wakes,
so one decode step becomes one message however many requests the call carries. A request is live
from ``open`` until its last update (finish reason or error) or its cancellation; updates for a
request that is not live are dropped. The responses end once the caller has closed its side and no
request is live.

``serve_many`` runs a whole DecodeMany call over a coroutine that serves one request: each start
becomes a task of its own, cancelled by the request's cancel or the end of the call.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc

from pdserve.rpc.errors import RpcError
from pdserve.v1 import decode_pb2

logger = logging.getLogger(__name__)

# Serves one request of a call: posts its updates under its tag; raises RpcError to fail it.
RunOne = Callable[[int, decode_pb2.DecodeRequest, "UpdateStream"], Awaitable[None]]


class UpdateStream:
    def __init__(self) -> None:
        self._pending: list[decode_pb2.DecodeUpdate] = []
        self._wake = asyncio.Event()
        self._live: set[int] = set()
        self._input_closed = False

    def open(self, tag: int) -> bool:
        """Makes ``tag`` live; False if it already is (the caller reused a tag)."""
        if tag in self._live:
            return False
        self._live.add(tag)
        return True

    def post(
        self,
        tag: int,
        token_ids: Sequence[int] = (),
        finish_reason: str = "",
        code: grpc.StatusCode = grpc.StatusCode.OK,
        message: str = "",
    ) -> None:
        """Queues an update of a live request; a finish reason or an error code ends the request."""
        if tag not in self._live:
            return
        if finish_reason or code is not grpc.StatusCode.OK:
            self._live.discard(tag)
        self._queue(tag, token_ids, finish_reason, code, message)

    def reject(self, tag: int, code: grpc.StatusCode, message: str) -> None:
        """Answers a start that never became a request (its tag was already live)."""
        self._queue(tag, (), "", code, message)

    def cancel(self, tag: int) -> None:
        self._live.discard(tag)
        self._wake.set()

    def close_input(self) -> None:
        """The caller will start nothing more."""
        self._input_closed = True
        self._wake.set()

    async def responses(self) -> AsyncIterator[decode_pb2.DecodeManyResponse]:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._pending:
                updates, self._pending = self._pending, []
                yield decode_pb2.DecodeManyResponse(updates=updates)
            if self._input_closed and not self._live and not self._pending:
                return

    def _queue(
        self, tag: int, token_ids: Sequence[int], finish_reason: str, code: grpc.StatusCode, message: str
    ) -> None:
        self._pending.append(
            decode_pb2.DecodeUpdate(
                tag=tag,
                token_ids=token_ids,
                finish_reason=finish_reason,
                error_code=code.value[0],
                error_message=message,
            )
        )
        self._wake.set()


async def serve_many(
    requests: AsyncIterator[decode_pb2.DecodeManyRequest], run_one: RunOne
) -> AsyncIterator[decode_pb2.DecodeManyResponse]:
    """The responses of one DecodeMany call whose requests ``run_one`` serves."""
    stream = UpdateStream()
    tasks: dict[int, asyncio.Task[None]] = {}

    async def run(tag: int, request: decode_pb2.DecodeRequest) -> None:
        try:
            await run_one(tag, request, stream)
        except RpcError as exc:
            stream.post(tag, code=exc.code, message=exc.message)
        except Exception:
            logger.exception("request %s (tag %d) failed", request.request_id, tag)
            stream.post(tag, code=grpc.StatusCode.INTERNAL, message="internal error")

    def forget(tag: int, task: asyncio.Task[None]) -> None:
        if tasks.get(tag) is task:
            del tasks[tag]

    async def read() -> None:
        try:
            async for message in requests:
                tag, action = message.tag, message.WhichOneof("action")
                if action == "start":
                    if not stream.open(tag):
                        stream.reject(tag, grpc.StatusCode.INVALID_ARGUMENT, f"tag {tag} is already in use")
                        continue
                    task = asyncio.create_task(run(tag, message.start))
                    tasks[tag] = task
                    task.add_done_callback(functools.partial(forget, tag))
                elif action == "cancel":
                    stream.cancel(tag)
                    running = tasks.pop(tag, None)
                    if running is not None:
                        running.cancel()
        finally:
            stream.close_input()

    reader = asyncio.create_task(read())
    try:
        async for response in stream.responses():
            yield response
    finally:
        reader.cancel()
        for task in list(tasks.values()):
            task.cancel()
