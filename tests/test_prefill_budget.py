"""The prefill batches waiting prompts up to its token budget (batch size x longest prompt), in
order of arrival, runs a step's prompts in forwards of at most its forward tokens, and every prompt
still gets the first token of a lone forward."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from pdserve.core.sampling import SamplingParams
from prefill_service.engine import PrefillEngine
from tests.engine_models import eager_engine_model
from tests.test_equivalence import reference_tokens


@pytest.mark.parametrize(
    ("max_forward_tokens", "batch_sizes"),
    [
        # In order: 4 x 12 fills the budget exactly (12 x 4 = 48); 20 would make it 20 x 5 = 100.
        (0, [1, 4, 4, 4, 4, 2, 2, 1]),
        # The step of 4 x 12 runs as two forwards of 2 x 12; 2 x 20 as two lone forwards.
        (24, [1, 2, 2, 2, 2, 1, 1, 1]),
    ],
)
def test_waiting_prompts_are_batched_up_to_the_token_budget(
    cache_dir: Path, max_forward_tokens: int, batch_sizes: list[int]
) -> None:
    m = eager_engine_model("tiny-llama", cache_dir)
    engine = PrefillEngine(m, m.device, max_batch_tokens=48, max_forward_tokens=max_forward_tokens)
    generator = torch.Generator().manual_seed(4)
    # A long prompt keeps the engine busy while the others arrive and wait together.
    lengths = [m.limits.max_model_len - 1, 12, 9, 12, 3, 20, 20, 1]
    prompts = [torch.randint(3, m.limits.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    params = SamplingParams(max_tokens=1, temperature=0.0)

    async def run_all() -> list[int]:
        first = asyncio.ensure_future(engine.run(prompts[0], params))
        await asyncio.sleep(0.005)  # the long prompt is in its forward
        results = await asyncio.gather(first, *(engine.run(p, params) for p in prompts[1:]))
        assert results[0].forward_seconds > 0.02, "the long prompt did not keep the engine busy"
        assert [r.first_token_id for r in results] == [reference_tokens(m.model, p, 1)[0] for p in prompts]
        return [r.batch_size for r in results]

    try:
        assert asyncio.run(run_all()) == batch_sizes
    finally:
        engine.close()
