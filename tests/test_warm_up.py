"""The engines' warm-ups (run at start-up with ``--compile``) leave nothing behind: no KV blocks,
no counted steps, and the requests that follow get the tokens they get without a warm-up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from decode_service.engine import DecodeEngine
from decode_service.kv_pool import KvPool
from decode_service.metrics import DecodeMetrics
from pdserve.config import EngineConfig
from pdserve.core.sampling import SamplingParams
from pdserve.model.engine_model import load_engine_model
from prefill_service.engine import PrefillEngine
from tests.engine_models import eager_engine_model
from tests.test_decode_engine import run_one
from tests.test_equivalence import reference_tokens


def test_decode_warm_up_frees_its_blocks_and_counts_no_steps(cache_dir: Path) -> None:
    m = load_engine_model(EngineConfig(model="tiny-mla-moe", cache_dir=str(cache_dir)))
    pool = KvPool(m.kv_layout, 64, 16, m.device)
    metrics = DecodeMetrics(CollectorRegistry())
    engine = DecodeEngine(m, metrics, 8, pool)
    engine.start()
    try:
        assert engine.warm_up() > 0
        assert pool.num_used_blocks == 0
        assert metrics.registry.get_sample_value("pdserve_decode_steps_total") == 0
        assert metrics.registry.get_sample_value("pdserve_decode_generated_tokens_total") == 0
        prompt = torch.randint(3, m.limits.vocab_size, (11,), generator=torch.Generator().manual_seed(3))
        assert run_one(engine, m, prompt.tolist(), 4) == reference_tokens(m.model, prompt.tolist(), 4)
        assert metrics.registry.get_sample_value("pdserve_decode_generated_tokens_total") == 3
    finally:
        engine.stop()
    assert pool.num_used_blocks == 0


def test_prefill_warm_up_then_requests(cache_dir: Path) -> None:
    m = eager_engine_model("tiny-llama", cache_dir)
    engine = PrefillEngine(m, torch.device("cpu"))
    try:
        assert engine.warm_up() > 0
        prompt = torch.randint(
            3, m.limits.vocab_size, (9,), generator=torch.Generator().manual_seed(4)
        ).tolist()
        result = asyncio.run(engine.run(prompt, SamplingParams(max_tokens=2, temperature=0.0)))
        assert [result.first_token_id] == reference_tokens(m.model, prompt, 1)
        assert result.kv_buffer is not None and result.num_tokens == len(prompt)
    finally:
        engine.close()
