"""The ``n`` choices of one request, streamed together (``RequestFlow`` runs each one).

The request is prefilled once; the prefill answers every choice's first token and, for each choice
that goes on, a handle of its own onto the prompt's one parked KV (``choice_answers``). Each choice
then runs as a request of its own would from its first token (its sampling rules from
``pdserve.core.choices``: its own seed; its own decode, stop strings, finish and migration), all
of them at once. ``merged`` interleaves their responses as they come, each carrying its choice's
``index``, and ends when the last choice has finished. When one choice fails the request fails, and
when the client goes away (the merged stream is closed) every choice still running is cancelled:
each one's decode is cancelled and its KV, when not yet pulled, released.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence

import grpc

from gateway.stream_merge import interleaved
from pdserve.core.choices import choice_params
from pdserve.core.sampling import SamplingParams
from pdserve.rpc.errors import RpcError
from pdserve.v1 import gateway_pb2, prefill_pb2

Responses = AsyncGenerator[gateway_pb2.GenerateResponse, None]


def choices_params(params: SamplingParams) -> list[SamplingParams]:
    """Each choice's sampling rules, in index order."""
    return [choice_params(params, index) for index in range(params.n)]


def choice_answers(answer: prefill_pb2.PrefillResponse, n: int) -> list[prefill_pb2.PrefillResponse]:
    """The prefill's answer of an ``n``-choice request as one answer per choice, in index order."""
    if len(answer.choices) != n:
        raise RpcError(
            grpc.StatusCode.INTERNAL, f"prefill answered {len(answer.choices)} choices of the {n} asked for"
        )
    return [
        prefill_pb2.PrefillResponse(
            first_token_id=choice.first_token_id,
            finish_reason=choice.finish_reason,
            kv_handle=choice.kv_handle if choice.HasField("kv_handle") else None,
            queue_seconds=answer.queue_seconds,
            first_token_logprobs=(
                choice.first_token_logprobs if choice.HasField("first_token_logprobs") else None
            ),
            prompt_logprobs=answer.prompt_logprobs,  # the prompt's, the same for every choice
        )
        for choice in answer.choices
    ]


async def merged(streams: Sequence[Responses]) -> Responses:
    """Every stream's responses as they come, each with its stream's position as ``index``; a
    stream's error ends the merged stream with it. Closing the merged stream cancels the rest."""
    async with contextlib.aclosing(interleaved(streams)) as items:
        async for index, response in items:
            response.index = index
            yield response
