"""The prompts of one completions request served together (vLLM's batched ``prompt``: a list of
texts, or of token-id lists).

Each prompt runs as a request of its own, with the request's sampling rules, all at once; their
responses come as one stream, prompt ``p``'s choice ``i`` being the response's choice ``p * n + i``,
as vLLM numbers them. When one prompt fails the request fails, and every prompt still running is
cancelled (``gateway.stream_merge``).

A streamed response starts once every prompt has its first token (``started``), so that an error
any prompt meets before then (bad input, no replica) is the HTTP status of the whole request.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence

import grpc

from gateway.stream_merge import interleaved
from pdserve.rpc.errors import RpcError
from pdserve.v1 import gateway_pb2

Responses = AsyncGenerator[gateway_pb2.GenerateResponse, None]


def prompt_request_id(request_id: str, position: int, prompts: int) -> str:
    """The id of a batch's ``position``-th prompt: the request's id alone for one prompt, else
    with ``-position`` after it."""
    return request_id if prompts == 1 else f"{request_id}-{position}"


def batched(streams: Sequence[Responses], n: int) -> Responses:
    """Every prompt's responses as they come, renumbered as the batch's choices."""
    return streams[0] if len(streams) == 1 else _renumbered(streams, n)


async def _renumbered(streams: Sequence[Responses], n: int) -> Responses:
    async with contextlib.aclosing(interleaved(streams)) as items:
        async for position, response in items:
            response.index = position * n + response.index
            yield response


async def started(
    responses: Responses, prompts: int, n: int
) -> tuple[gateway_pb2.GenerateResponse, Responses]:
    """The first response, and the stream of the rest, once each of the ``prompts`` has given its
    first response; an error before then is raised here, with ``responses`` closed."""
    read: list[gateway_pb2.GenerateResponse] = []
    waiting = set(range(prompts))
    try:
        while waiting:
            response = await anext(responses)
            read.append(response)
            waiting.discard(response.index // n)
    except StopAsyncIteration:
        raise RpcError(grpc.StatusCode.INTERNAL, "the request ended without a response") from None
    except BaseException:
        await responses.aclose()
        raise
    return read[0], _then(read[1:], responses)


async def _then(read: list[gateway_pb2.GenerateResponse], rest: Responses) -> Responses:
    try:
        for response in read:
            yield response
        async for response in rest:
            yield response
    finally:
        await rest.aclose()
