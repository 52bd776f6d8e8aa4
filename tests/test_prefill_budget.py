"""The prefill batches waiting prompts up to its token budget (batch size x longest prompt), in
order of arrival, runs a step's prompts in forwards of at most its forward size (fixed, or following
the queue), and every prompt still gets the first token of a lone forward."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from pdserve.core.sampling import SamplingParams
from prefill_service.engine import PrefillEngine
from prefill_service.forward_size import ForwardSize
from tests.engine_models import eager_engine_model
from tests.test_equivalence import reference_tokens


@pytest.mark.parametrize(
    ("forward_size", "batch_sizes"),
    [
        # In order: 4 x 12 fills the budget exactly (12 x 4 = 48); 20 would make it 20 x 5 = 100.
        (None, [1, 4, 4, 4, 4, 2, 2, 1]),
        # The step of 4 x 12 runs as two forwards of 2 x 12; 2 x 20 as two lone forwards.
        (ForwardSize(24, 24), [1, 2, 2, 2, 2, 1, 1, 1]),
        # By the queue, its fixed cost not measured: forwards of the least size.
        (ForwardSize(24, 48), [1, 2, 2, 2, 2, 1, 1, 1]),
        # A fixed cost as large as the budget: forwards of the budget.
        (ForwardSize(24, 48, fixed_tokens=48.0), [1, 4, 4, 4, 4, 2, 2, 1]),
        # By the queue: the long prompt's ~2000 tokens still to run make sqrt(queued x 1) 40 to 47
        # tokens a forward: 3 x 12 (4 x 12 would be 48), then 2 x 20.
        (ForwardSize(24, 48, fixed_tokens=1.0), [1, 3, 3, 3, 1, 2, 2, 1]),
    ],
)
def test_waiting_prompts_are_batched_up_to_the_token_budget(
    cache_dir: Path, forward_size: ForwardSize | None, batch_sizes: list[int]
) -> None:
    m = eager_engine_model("tiny-llama", cache_dir)
    engine = PrefillEngine(m, m.device, max_batch_tokens=48, forward_size=forward_size)
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
