"""Prefix-aware routing over two real prefills: requests sharing a prefix land on one replica, a
prompt of another prefix can go to the other one, and the tokens are those of ``generate``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_no_leaks
from tests.grpc_client import make_request, run
from tests.stack import Stack, scrape
from tests.test_equivalence import reference_tokens

MODEL = "tiny-llama"

pytestmark = pytest.mark.timeout(600)


def served(stack: Stack) -> list[float]:
    return [scrape(p.metrics)["pdserve_prefill_requests_total"] for p in stack.prefills]


def test_same_prefix_requests_land_on_one_prefill(
    cache_dir: Path, tmp_path: Path, reference_models: Any
) -> None:
    model, _ = reference_models(MODEL)
    stack = Stack(MODEL, cache_dir, tmp_path, num_prefill=2).start()
    try:
        generator = torch.Generator().manual_seed(11)
        prefix = torch.randint(3, model.config.vocab_size, (48,), generator=generator).tolist()
        prompts = [
            prefix + torch.randint(3, model.config.vocab_size, (5,), generator=generator).tolist()
            for _ in range(5)
        ]
        for i, prompt in enumerate(prompts):
            result = run(
                stack.address,
                make_request(prompt_token_ids=prompt, max_tokens=2, temperature=0.0, ignore_eos=True),
            )
            if i == 0:
                assert result.token_ids == reference_tokens(model, prompt, 2)
        counts = served(stack)
        assert sorted(counts) == [0, 5], counts
        assert stack.gateway is not None
        routes = scrape(stack.gateway.metrics)
        assert routes["pdserve_gateway_prefill_routes_total{outcome=prefix}"] == 4
        assert routes["pdserve_gateway_prefill_routes_total{outcome=least-load}"] == 1
        # Another prefix, nothing outstanding: the least loaded replica by rotation, no prefix hit.
        other = torch.randint(3, model.config.vocab_size, (40,), generator=generator).tolist()
        run(stack.address, make_request(prompt_token_ids=other, max_tokens=1, temperature=0.0))
        assert scrape(stack.gateway.metrics)["pdserve_gateway_prefill_routes_total{outcome=least-load}"] == 2
        assert sum(served(stack)) == 6
        assert_no_leaks(stack)
    finally:
        stack.stop()


def test_each_prefill_s_cache_capacity_keeps_a_prefix_in_use_where_it_is(
    cache_dir: Path, tmp_path: Path, reference_models: Any
) -> None:
    """Two prefills whose caches hold 4 blocks of 16 tokens. A prefix in use (3 blocks, routed twice)
    stays a hit while one-off prompts of 4 blocks go by: each answer tells the gateway its prefill's
    capacity, and a one-off prompt goes where it evicts nothing reused, the other prefill."""
    model, _ = reference_models(MODEL)
    stack = Stack(
        MODEL, cache_dir, tmp_path, num_prefill=2, prefill_args=["--prefix-cache-tokens", "64"]
    ).start()
    try:
        generator = torch.Generator().manual_seed(12)

        def draw(n: int) -> list[int]:
            return torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist()

        def cached(prompt: list[int]) -> int:
            request = make_request(prompt_token_ids=prompt, max_tokens=2, temperature=0.0, ignore_eos=True)
            result = run(stack.address, request)
            assert result.token_ids == reference_tokens(model, prompt, 2)
            return result.chunks[0].num_cached_tokens

        prefix = draw(48)
        assert [cached(prefix + draw(5)) for _ in range(2)] == [0, 48]
        holder = max(range(2), key=lambda i: served(stack)[i])
        for _ in range(3):
            assert cached(draw(64)) == 0
            assert cached(prefix + draw(5)) == 48
        counts = served(stack)
        assert counts[holder] == 5 and counts[1 - holder] == 3, counts
        assert_no_leaks(stack)
    finally:
        stack.stop()
