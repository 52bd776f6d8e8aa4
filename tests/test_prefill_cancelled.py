"""A request cancelled while its prompt is in a forward (its client or the gateway gone): the KV
buffer set aside for it goes back to the prefill's shared-memory arena; nothing else would park or
free it."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.core.sampling import SamplingParams
from pdserve.kv.shared_memory import SharedArena
from pdserve.kv.transports import AUTO, Place
from prefill_service.engine import PrefillEngine
from prefill_service.kv_space import KvSpace
from tests.engine_models import eager_engine_model


@pytest.fixture
def space(tmp_path: Path) -> Iterator[KvSpace]:
    arena = SharedArena(tmp_path, secrets.token_hex(8), 1 << 22)
    space = KvSpace(AUTO, Place("host", "cpu"), torch.device("cpu"), arena)
    yield space
    space.close()


def test_a_request_cancelled_during_its_forward_gives_its_kv_memory_back(
    space: KvSpace, cache_dir: Path
) -> None:
    m = eager_engine_model("tiny-llama", cache_dir)
    engine = PrefillEngine(m, space, max_batch_tokens=m.limits.max_model_len)
    prompt = torch.randint(
        3, m.limits.vocab_size, (m.limits.max_model_len - 1,), generator=torch.Generator().manual_seed(3)
    )
    params = SamplingParams(max_tokens=4, temperature=0.0)  # goes on to decode: its KV is packed

    async def scenario() -> None:
        call = asyncio.ensure_future(engine.run(prompt.tolist(), params))
        deadline = time.monotonic() + 30
        while engine.num_running == 0:  # in its forward
            assert time.monotonic() < deadline, "the prompt never began"
            await asyncio.sleep(0.001)
        call.cancel()
        while space.arena_bytes_used or engine.num_running:
            assert time.monotonic() < deadline, "the cancelled request's KV stayed in the arena"
            await asyncio.sleep(0.01)
        # The arena serves the next request as before.
        result = await engine.run(prompt.tolist()[:20], params)
        assert result.kv is not None and result.kv.arena_offset is not None
        result.kv.free()
        assert space.arena_bytes_used == 0

    try:
        asyncio.run(scenario())
    finally:
        engine.close()
