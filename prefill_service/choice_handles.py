"""The Prefill answer of a request with ``n`` > 1 choices: each choice's first token, and a handle
onto the prompt's one parked KV for each choice that goes on to decode (``KvRegistry.park_shared``).
When every choice is complete at its first token nothing was packed and nothing is parked."""

from __future__ import annotations

from pdserve.kv.handle import HandleIssuer
from pdserve.rpc.logprobs_proto import logprobs_list_to_proto, logprobs_to_proto
from pdserve.v1 import prefill_pb2
from prefill_service.engine import PrefillResult
from prefill_service.kv_registry import KvRegistry
from prefill_service.metrics import PrefillMetrics


def choices_response(
    result: PrefillResult,
    registry: KvRegistry,
    issuer: HandleIssuer,
    metrics: PrefillMetrics,
    block_size: int = 0,
) -> prefill_pb2.PrefillResponse:
    """``block_size``: tokens per block of the prefix cache (``PrefillResult.block_ids``)."""
    going_on = [c for c in result.choices if c.finish_reason is None]
    handles = []
    if going_on:
        if result.kv is None:
            raise RuntimeError("a choice goes on to decode but its prompt's KV was not packed")
        entries = registry.park_shared(result.kv, result.num_tokens, len(going_on))
        metrics.kv_parks.inc(len(entries))
        handles = [issuer.issue(entry, block_size, result.block_ids) for entry in entries]
    response = prefill_pb2.PrefillResponse(queue_seconds=result.queue_seconds)
    response.prompt_logprobs.extend(logprobs_list_to_proto(result.prompt_logprobs))
    for index, choice in enumerate(result.choices):
        if choice.finish_reason is not None:
            metrics.finished_at_first_token.labels(choice.finish_reason).inc()
            added = response.choices.add(first_token_id=choice.token_id, finish_reason=choice.finish_reason)
        else:
            added = response.choices.add(first_token_id=choice.token_id, kv_handle=handles.pop(0))
        if result.choice_logprobs:
            added.first_token_logprobs.CopyFrom(logprobs_to_proto(result.choice_logprobs[index]))
    return response
