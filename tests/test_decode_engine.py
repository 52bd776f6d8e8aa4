"""The decode engine in process: one request after another must never see another's context."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from transformers import DynamicCache

from decode_service.engine import DecodeEngine
from decode_service.kv_pool import KvPool
from decode_service.metrics import DecodeMetrics
from decode_service.sequence import DecodeSequence, Emission
from pdserve.config import EngineConfig
from pdserve.core.sampling import SamplingParams
from pdserve.model.engine_model import load_engine_model
from tests.test_equivalence import reference_tokens


def run_one(engine: DecodeEngine, m: Any, prompt: list[int], max_tokens: int) -> list[int]:
    cache = DynamicCache(config=m.model.config)
    with torch.no_grad():
        logits = m.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits
    first = int(logits[0, -1].argmax())
    tokens = [first]
    done = threading.Event()

    def emit(emission: Emission) -> None:
        tokens.extend(emission.token_ids)
        if emission.finish_reason is not None or emission.error is not None:
            done.set()

    kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.submit(DecodeSequence("r", kv, first, params, emit))
    assert done.wait(60)
    return tokens


def test_back_to_back_requests_get_their_own_context(cache_dir: Path) -> None:
    m = load_engine_model(EngineConfig(model="tiny-mla-moe", cache_dir=str(cache_dir)))
    pool = KvPool(m.kv_layout, 64, 16, m.device)
    engine = DecodeEngine(m, DecodeMetrics(CollectorRegistry()), 8, pool)
    engine.start()
    try:
        generator = torch.Generator().manual_seed(5)
        for n in (9, 4, 9, 17, 9, 2):
            prompt = torch.randint(3, m.limits.vocab_size, (n,), generator=generator).tolist()
            got = run_one(engine, m, prompt, 3)
            gc.collect()  # a finished request's object may be freed and its address reused
            assert got == reference_tokens(m.model, prompt, 3)
    finally:
        engine.stop()
    assert pool.num_used_blocks == 0
