"""The correctness gate: the disaggregated path reproduces greedy `model.generate` token for token."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from tests.conftest import PRESETS
from tests.grpc_client import generate_many, make_request

PROMPT_LENGTHS = (1, 3, 9, 24, 50, 97, 150, 200)
MAX_TOKENS = (1, 64, 2, 33, 64, 7, 48, 64)


def reference_tokens(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=model.generation_config.pad_token_id or 0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def divergence_report(model: Any, prompt: list[int], ref: list[int], got: list[int]) -> str:
    i = next((k for k, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got)))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:i]])).logits[0, -1]
    top = torch.topk(logits.float(), 2)
    margin = float(top.values[0] - top.values[1])
    return (
        f"diverged at token {i} (prompt of {len(prompt)}): reference {ref[i : i + 5]}, got {got[i : i + 5]}; "
        f"reference top-1/top-2 margin {margin:.3g} (ids {top.indices.tolist()})"
    )


@pytest.mark.parametrize("model_name", PRESETS)
def test_greedy_matches_generate(model_name: str, stack_pool: Any, reference_models: Any) -> None:
    stack = stack_pool.get(model_name)
    model, _ = reference_models(model_name)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(20261129)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    requests = [
        make_request(prompt_token_ids=p, max_tokens=m, temperature=0.0)
        for p, m in zip(prompts, MAX_TOKENS, strict=True)
    ]
    results = asyncio.run(generate_many(stack.address, requests))
    configured_eos = model.generation_config.eos_token_id
    eos = set(configured_eos if isinstance(configured_eos, list) else [configured_eos])
    for prompt, max_tokens, result in zip(prompts, MAX_TOKENS, results, strict=True):
        ref = reference_tokens(model, prompt, max_tokens)
        assert result.token_ids == ref, divergence_report(model, prompt, ref, result.token_ids)
        assert result.finish_reason == ("eos" if ref[-1] in eos else "length")
        assert result.chunks[0].num_prompt_tokens == len(prompt)
        assert len(result.chunks[0].token_ids) == 1, "the first chunk carries exactly the prefill's token"
