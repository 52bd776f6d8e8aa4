"""Greedy tokens of requests a decode engine runs as one batch, given each one's prefilled KV."""

from __future__ import annotations

import threading

import torch

from decode_service.engine import DecodeEngine
from decode_service.kv_pool import KvPool
from decode_service.sequence import DecodeSequence, Emission
from pdserve.core.sampling import SamplingParams

Prefilled = tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]  # first token, per layer [heads, len, width]


def decode_as_one_batch(
    engine: DecodeEngine, pool: KvPool, prefilled: list[Prefilled], max_tokens: int
) -> list[list[int]]:
    """Each request's greedy tokens, its first included: every request waits before the engine
    starts, so they run as one batch; the engine is stopped and its pool holds nothing after."""
    results, done = [], []
    for i, (first, kv) in enumerate(prefilled):
        tokens = [first]
        event = threading.Event()

        def emit(emission: Emission, tokens: list[int] = tokens, event: threading.Event = event) -> None:
            tokens.extend(emission.token_ids)
            if emission.finish_reason is not None or emission.error is not None:
                event.set()

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.submit(DecodeSequence(f"r{i}", kv, first, params, emit))
        results.append(tokens)
        done.append(event)
    engine.start()
    try:
        assert all(event.wait(120) for event in done)
    finally:
        engine.stop()
    assert pool.num_used_blocks == 0
    return results
