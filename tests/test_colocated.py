"""`pdserve up --mode colocated`: prefill and decode in one process, the KV handed over in memory."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import torch

from tests.grpc_client import generate, generate_many, make_request
from tests.stack import scrape, wait_for
from tests.test_equivalence import divergence_report, reference_tokens
from tests.test_up import pdserve_up


def test_colocated_stack_matches_generate(cache_dir: Path, tmp_path: Path, reference_models: Any) -> None:
    model, _ = reference_models("tiny-mla-moe")
    with pdserve_up(
        cache_dir, tmp_path / "up.log", "--mode", "colocated", "--model", "tiny-mla-moe", "--port", "0"
    ) as (up, ready):
        prefill, decode = ready["prefill"][0], ready["decode"][0]
        assert prefill["grpc"] == decode["grpc"] and prefill["pid"] == decode["pid"]
        assert prefill["metrics"] != decode["metrics"]

        generator = torch.Generator().manual_seed(3)
        prompts = [
            torch.randint(3, model.config.vocab_size, (n,), generator=generator).tolist() for n in (2, 31, 90)
        ]
        max_tokens = [20, 1, 33]
        requests = [
            make_request(prompt_token_ids=p, max_tokens=n, temperature=0.0)
            for p, n in zip(prompts, max_tokens, strict=True)
        ]
        results = asyncio.run(generate_many(ready["gateway"]["grpc"], requests))
        for prompt, n, result in zip(prompts, max_tokens, results, strict=True):
            ref = reference_tokens(model, prompt, n)
            assert result.token_ids == ref, divergence_report(model, prompt, ref, result.token_ids)
        # Three choices decode from the one KV their prefill parked, each handed over in memory.
        request = make_request(prompt_token_ids=prompts[1], max_tokens=12, temperature=0.0, n=3)
        choices = asyncio.run(generate(ready["gateway"]["grpc"], request))
        ref = reference_tokens(model, prompts[1], 12)
        for index in range(3):
            assert [t for c in choices.chunks if c.index == index for t in c.token_ids] == ref

        prefill_metrics = scrape(prefill["metrics"])
        assert prefill_metrics["pdserve_kv_pulls_total"] == 2 + 3  # the max_tokens=1 request parked nothing
        assert prefill_metrics["pdserve_kv_sent_bytes_total"] == 0, "a colocated handoff moved bytes"
        assert wait_for(lambda: scrape(prefill["metrics"])["pdserve_kv_parked_handles"] == 0)
        assert wait_for(lambda: scrape(decode["metrics"])["pdserve_decode_running"] == 0)
        assert scrape(decode["metrics"])["pdserve_decode_kv_blocks_used"] == 0

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
