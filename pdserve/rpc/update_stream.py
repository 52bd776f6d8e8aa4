"""The serving side of one DecodeMany call: its requests' updates, gathered into few messages.

Producers ``post`` updates as they come (a decode step posts one per running request of the call,
all from one event-loop callback); ``responses`` sends whatever has gathered each time it wakes,
so one decode step becomes one message however many requests the call carries. A request is live
from ``open`` until its last update (finish reason or error) or its cancellation; updates for a
request that is not live are dropped. The responses end once the caller has closed its side and no
request is live.

``serve_many`` runs a whole DecodeMany call over a coroutine that serves one request: each start
becomes a task of its own, cancelled by the request's cancel or the end of the call. ``serve_one``
runs a Decode call (one request) as a DecodeMany call of that request alone: its updates become
DecodeResponse messages, and an update's error ends the call with that update's status.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from pdserve.core.logprobs import TokenLogprobs
from pdserve.rpc.errors import RpcError, abort, status_code
from pdserve.rpc.logprobs_proto import logprobs_list_to_proto
from pdserve.v1 import decode_pb2

logger = logging.getLogger(__name__)

ONLY_TAG = 0  # the tag of the request of a Decode call

# Serves one request of a call: posts its updates under its tag; raises RpcError to fail it.
# ``serve_many`` runs it until the request's last update (a request whose ``RunOne`` returns before
# that stays live until the caller cancels it).
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
        logprobs: Sequence[TokenLogprobs] = (),
    ) -> None:
        """Queues an update of a live request; a finish reason or an error code ends the request."""
        if tag not in self._live:
            return
        if finish_reason or code is not grpc.StatusCode.OK:
            self._live.discard(tag)
        self._queue(tag, token_ids, finish_reason, code, message, logprobs)

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
        self,
        tag: int,
        token_ids: Sequence[int],
        finish_reason: str,
        code: grpc.StatusCode,
        message: str,
        logprobs: Sequence[TokenLogprobs] = (),
    ) -> None:
        self._pending.append(
            decode_pb2.DecodeUpdate(
                tag=tag,
                token_ids=token_ids,
                finish_reason=finish_reason,
                error_code=code.value[0],
                error_message=message,
                logprobs=logprobs_list_to_proto(logprobs),
            )
        )
        self._wake.set()


async def serve_many(
    requests: AsyncIterator[decode_pb2.DecodeManyRequest], run_one: RunOne
) -> AsyncGenerator[decode_pb2.DecodeManyResponse, None]:
    """The responses of one DecodeMany call whose requests ``run_one`` serves."""
    stream = UpdateStream()
    tasks: dict[int, asyncio.Task[None]] = {}

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
                    task = asyncio.create_task(_run(run_one, tag, message.start, stream))
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


async def serve_one(
    request: decode_pb2.DecodeRequest, run_one: RunOne, context: Any
) -> AsyncIterator[decode_pb2.DecodeResponse]:
    """The responses of one Decode call: ``request`` served as the only request of a DecodeMany call.

    The updates gathered in one DecodeMany message become one response; an error aborts the call.
    """
    async with contextlib.aclosing(serve_many(_only(request), run_one)) as responses:
        async for response in responses:
            last = response.updates[-1]  # nothing follows a request's last update
            if last.error_code:
                await abort(context, status_code(last.error_code), last.error_message)
            token_ids = [t for update in response.updates for t in update.token_ids]
            logprobs = [entry for update in response.updates for entry in update.logprobs]
            yield decode_pb2.DecodeResponse(
                token_ids=token_ids, finish_reason=last.finish_reason, logprobs=logprobs
            )


async def _run(run_one: RunOne, tag: int, request: decode_pb2.DecodeRequest, stream: UpdateStream) -> None:
    """Runs one request of a call; its failure becomes its last update."""
    try:
        await run_one(tag, request, stream)
    except RpcError as exc:
        stream.post(tag, code=exc.code, message=exc.message)
    except Exception:
        logger.exception("request %s (tag %d) failed", request.request_id, tag)
        stream.post(tag, code=grpc.StatusCode.INTERNAL, message="internal error")


async def _only(request: decode_pb2.DecodeRequest) -> AsyncIterator[decode_pb2.DecodeManyRequest]:
    yield decode_pb2.DecodeManyRequest(tag=ONLY_TAG, start=request)
