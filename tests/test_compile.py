"""Compiled forwards (``--compile auto``, the default, compiles tiny-llama on CPU): the same greedy
tokens, every compilation in the start-up warm-up, before the services are ready (checked with
``--recompile-in-serving``, under which a class the warm-up missed would compile while serving), and
a later start loads the compiled code from the cache dir instead of compiling again, then stops
compiling (by default a class its warm-up missed runs eagerly)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_no_leaks
from tests.grpc_client import generate_many, make_request
from tests.stack import ServiceProcess, Stack, scrape
from tests.test_equivalence import divergence_report, reference_tokens

MODEL = "tiny-llama"

pytestmark = pytest.mark.timeout(1200)


def compiles(stack: Stack) -> dict[str, float]:
    """Frames compiled so far by each prefill and decode process."""
    counts = {}
    for i, prefill in enumerate(stack.prefills):
        counts[f"prefill{i}"] = scrape(prefill.metrics)["pdserve_prefill_compiles_total"]
    for i, decode in enumerate(stack.decodes):
        counts[f"decode{i}"] = scrape(decode.metrics)["pdserve_decode_compiles_total"]
    return counts


def test_compiled_engines_match_generate(cache_dir: Path, tmp_path: Path, reference_models: Any) -> None:
    model, _ = reference_models(MODEL)
    # With inductor's cache cold, the two warm-ups take over a minute on 2 cores.
    stack = Stack(
        MODEL,
        cache_dir,
        tmp_path,
        # The tests' services run eager unless asked (PDSERVE_COMPILE=false): auto is the default.
        prefill_args=["--compile", "auto", "--recompile-in-serving", "true"],
        decode_args=["--compile", "auto", "--recompile-in-serving", "true"],
        ready_timeout_s=720,
    ).start()
    try:
        prefill_metrics = scrape(stack.prefills[0].metrics)
        decode_metrics = scrape(stack.decodes[0].metrics)
        assert prefill_metrics["pdserve_prefill_warmup_seconds"] > 0
        # Its forwards follow the queue (CPU), their fixed cost measured after the warm-up.
        assert 0 < prefill_metrics["pdserve_prefill_forward_fixed_tokens"] <= 512
        assert decode_metrics["pdserve_decode_warmup_seconds"] > 0
        # The warm-up's steps are not counted as served work.
        assert decode_metrics["pdserve_decode_steps_total"] == 0
        assert decode_metrics["pdserve_decode_generated_tokens_total"] == 0
        compiled_at_ready = compiles(stack)
        assert all(count > 0 for count in compiled_at_ready.values()), compiled_at_ready

        generator = torch.Generator().manual_seed(7)
        prompts = [
            torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist()
            for n in (3, 40, 17, 1)
        ]
        # Two prompts over prompt 1's first two blocks (the prefix cache holds them after it ran).
        prompts += [[*prompts[1][:32], *prompts[2][:n]] for n in (3, 6)]
        max_tokens = [12, 20, 1, 5, 4, 6]
        # One request alone, then several together, then a one-token prompt, then prompts over
        # cached prefixes, alone and together: new shapes for the forwards, each compiled by the
        # warm-up already.
        for batch in ([0], [0, 1, 2], [3], [3, 0], [1], [4, 5, 2]):
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
        assert compiles(stack) == compiled_at_ready
        assert_no_leaks(stack)
        cold = cache_lookups(prefill_metrics)
        assert cold["miss"] > 0, cold

        # A second prefill on the same cache dir: the warm-up finds every graph compiled.
        again = ServiceProcess(
            "prefill",
            ["--model", MODEL, "--host", "127.0.0.1", "--compile", "auto"],
            stack.prefills[0].env,
            tmp_path / "prefill-warm.log",
        )
        again.start()
        try:
            again.wait_ready(600)
            warm = cache_lookups(scrape(again.metrics))
            assert warm["hit"] > 0 and warm["miss"] == 0, warm
            assert (
                "warm-ups done: a shape class they did not compile runs eagerly"
                in (tmp_path / "prefill-warm.log").read_text()
            )
        finally:
            again.stop()
    finally:
        stack.stop()


def cache_lookups(metrics: dict[str, float]) -> dict[str, float]:
    """The prefill's lookups of inductor's FX-graph cache, by result."""
    return {
        result: metrics[f"pdserve_prefill_compile_cache_lookups_total{{cache=fx_graph,result={result}}}"]
        for result in ("hit", "miss")
    }
