"""Seeded sampling through the stack equals the same sampler run in one process."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from transformers import DynamicCache

from pdserve.core.finish import finish_reason
from pdserve.core.sampling import SamplingParams, sample
from pdserve.rpc.sampling_proto import sampling_from_proto
from pdserve.v1 import sampling_pb2
from tests.conftest import StackPool
from tests.grpc_client import generate_many, make_request, run

MODEL = "tiny-moe"


def one_process(model: Any, prompt: list[int], params: SamplingParams, eos: set[int]) -> list[int]:
    """Prefill then decode in one process with the shared sampler: the reference."""
    cache = DynamicCache(config=model.config)
    tokens: list[int] = []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
        while True:
            token = sample(logits, params, step=len(tokens))
            tokens.append(token)
            if finish_reason(token, len(tokens), params, eos) is not None:
                return tokens
            logits = model(torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]


SETTINGS = (
    {"temperature": 1.0, "seed": 1},
    {"temperature": 0.75, "top_k": 20, "seed": 2},
    {"temperature": 1.3, "top_p": 0.9, "seed": 3},
    {"temperature": 0.5, "top_k": 50, "top_p": 0.8, "seed": 2**63 + 12345},
)


def test_seeded_sampling_matches_one_process(stack_pool: StackPool, reference_models: Any) -> None:
    stack = stack_pool.get(MODEL)
    model, _ = reference_models(MODEL)
    eos_id = model.generation_config.eos_token_id
    eos = set(eos_id if isinstance(eos_id, list) else [eos_id])
    prompts = [[3, 14, 15, 92, 65], list(range(100, 160)), [7] * 12, [1, 2]]
    requests = [
        make_request(prompt_token_ids=p, max_tokens=24, **s) for p, s in zip(prompts, SETTINGS, strict=True)
    ]
    results = asyncio.run(generate_many(stack.address, requests))
    for prompt, request, result in zip(prompts, requests, results, strict=True):
        params = sampling_from_proto(request.sampling)
        expected = one_process(model, prompt, params, eos)
        assert result.token_ids == expected, f"settings {request.sampling}"
    # Not greedy in disguise: sampled and greedy continuations differ somewhere.
    greedy = asyncio.run(
        generate_many(
            stack.address, [make_request(prompt_token_ids=p, max_tokens=24, temperature=0.0) for p in prompts]
        )
    )
    assert any(g.token_ids != r.token_ids for g, r in zip(greedy, results, strict=True))


def test_same_seed_same_tokens_other_seed_other_tokens(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)
    prompt = [11, 22, 33, 44]

    def sampled(seed: int) -> list[int]:
        request = make_request(
            prompt_token_ids=prompt, max_tokens=16, temperature=1.0, seed=seed, ignore_eos=True
        )
        return run(stack.address, request).token_ids

    assert sampled(7) == sampled(7)
    assert len({tuple(sampled(seed)) for seed in range(4)}) > 1


def test_unseeded_sampling_runs(stack_pool: StackPool) -> None:
    stack = stack_pool.get(MODEL)
    request = make_request(prompt_token_ids=[1, 2, 3], max_tokens=8, temperature=1.0, ignore_eos=True)
    assert len(run(stack.address, request).token_ids) == 8
    assert sampling_pb2.SamplingParams().HasField("seed") is False
