"""``--compile``: the engines' forwards through torch.compile give the same greedy tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_no_leaks
from tests.grpc_client import generate_many, make_request
from tests.stack import Stack
from tests.test_equivalence import divergence_report, reference_tokens

MODEL = "tiny-llama"

pytestmark = pytest.mark.timeout(600)


def test_compiled_engines_match_generate(cache_dir: Path, tmp_path: Path, reference_models: Any) -> None:
    model, _ = reference_models(MODEL)
    stack = Stack(MODEL, cache_dir, tmp_path, prefill_args=["--compile"], decode_args=["--compile"]).start()
    try:
        generator = torch.Generator().manual_seed(7)
        prompts = [
            torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in (3, 40, 17)
        ]
        max_tokens = [12, 20, 1]
        for batch in ([0], [0, 1, 2]):  # one request alone, then several together (new shapes)
            requests = [
                make_request(
                    prompt_token_ids=prompts[i], max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True
                )
                for i in batch
            ]
            results = asyncio.run(generate_many(stack.address, requests))
            for i, result in zip(batch, results, strict=True):
                ref = reference_tokens(model, prompts[i], max_tokens[i])
                assert result.token_ids == ref, divergence_report(model, prompts[i], ref, result.token_ids)
        assert_no_leaks(stack)
    finally:
        stack.stop()
