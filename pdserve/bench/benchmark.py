"""One benchmark run against a base URL, from config to JSON-ready result.

1. The model id is ``--model`` or the first of ``GET /v1/models``; the tokenizer (for prompts and
   token counts) is ``--tokenizer``, else ``--launch``, else the model id when it names a local
   directory or a pdserve preset.
2. Warm-up, then the measured requests; the CPU seconds of the server trees are taken around the
   measured part only.
3. Metrics, the JSON-ready result and its table.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import aiohttp

from pdserve.bench.config import BenchConfig, parse_extra_body
from pdserve.bench.cpu_time import CpuMeter
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.mixed import mixed_result, run_mixed
from pdserve.bench.openai_client import first_model_id
from pdserve.bench.report import build_result, format_table
from pdserve.bench.runner import Target, TokenCounter, new_session, run_requests, send_request, warm_up
from pdserve.bench.workload import (
    MixedPrompts,
    arrival_offsets,
    candidate_ids,
    sample_requests,
    shared_prefix_requests,
)

UNREPORTED_FIELDS = ("json", "output_file", "progress", "server_pid", "launch_timeout_s", "request_timeout_s")


def load_tokenizer(spec: str) -> Any:
    """A transformers tokenizer from a directory or pdserve preset; None when ``spec`` names neither."""
    from transformers import AutoTokenizer

    from pdserve.model.source import PRESETS, resolve_model_dir

    path = Path(spec).expanduser()
    if spec and path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    if spec in PRESETS:
        return AutoTokenizer.from_pretrained(str(resolve_model_dir(spec)))
    return None


def token_counter(tokenizer: Any) -> TokenCounter | None:
    if tokenizer is None:
        return None
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


async def run_benchmark(config: BenchConfig, base_url: str, pids: list[int]) -> dict[str, Any]:
    """Runs ``config`` against ``base_url``; the result of ``report.build_result`` plus ``table``."""
    async with new_session(config.concurrency, config.api_key, config.tls_ca) as session:
        model = config.model or await first_model_id(session, base_url)
        tokenizer = load_tokenizer(config.tokenizer or config.launch or model)
        if config.tokenizer and tokenizer is None:
            raise ValueError(f"tokenizer {config.tokenizer!r} is neither a directory nor a pdserve preset")
        if config.workload != "reference":
            return await _run_workload(config, session, base_url, model, tokenizer, pids)
        requests = sample_requests(
            config.num_prompts,
            config.input_len,
            config.output_len,
            config.random_range_ratio,
            config.seed,
            token_ids=config.uses_token_ids,
            tokenizer=tokenizer,
            vocab_size=config.vocab_size,
        )
        offsets = arrival_offsets(config.num_prompts, config.request_rate, config.seed)
        target = _target(config, base_url, model)
        count_tokens = token_counter(tokenizer)
        await warm_up(session, target, requests[0], config.num_warmup, count_tokens)
        meter = CpuMeter(pids)
        meter.start()
        run = await run_requests(
            session, target, requests, offsets, config.concurrency, count_tokens, config.progress
        )
        server = meter.stop() if pids else None
    metrics = compute_metrics(run.records, run.duration_s, config.slo_ms)
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in UNREPORTED_FIELDS}
    settings.update(base_url=base_url, model=model, slo=list(config.slo))
    result = build_result(metrics, run.records, settings, server)
    result["table"] = format_table(metrics, server, title=f"{model} @ {base_url} ({config.endpoint})")
    return result


def _target(config: BenchConfig, base_url: str, model: str) -> Target:
    return Target(
        base_url,
        model,
        config.endpoint,
        config.temperature,
        config.ignore_eos,
        config.request_timeout_s,
        parse_extra_body(config.extra_body),
    )


def _settings(config: BenchConfig, base_url: str, model: str) -> dict[str, Any]:
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in UNREPORTED_FIELDS}
    settings.update(base_url=base_url, model=model, slo=list(config.slo))
    return settings


async def _run_workload(
    config: BenchConfig,
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    tokenizer: Any,
    pids: list[int],
) -> dict[str, Any]:
    """The shared-prefix or mixed workload (token-id prompts); the result as ``run_benchmark``'s."""
    vocab_size = config.vocab_size or (len(tokenizer) if tokenizer is not None else 0)
    if vocab_size < 1:
        raise ValueError(f"the {config.workload} workload needs a tokenizer or --vocab-size")
    ids = candidate_ids(vocab_size, tokenizer)
    target = _target(config, base_url, model)
    count_tokens = token_counter(tokenizer)
    title = f"{model} @ {base_url} ({config.workload})"
    meter = CpuMeter(pids)
    if config.workload == "shared-prefix":
        first, requests = shared_prefix_requests(
            config.prefix_requests,
            config.prefix_len,
            config.suffix_len,
            config.prefix_output_len,
            config.seed,
            ids,
            config.prefix_groups,
        )
        await warm_up(session, target, first, config.num_warmup, count_tokens)
        meter.start()
        run = await run_requests(
            session,
            target,
            requests,
            [0.0] * len(requests),
            config.prefix_concurrency,
            count_tokens,
            config.progress,
        )
        server = meter.stop() if pids else None
        metrics = compute_metrics(run.records, run.duration_s, config.slo_ms)
        result = build_result(metrics, run.records, _settings(config, base_url, model), server)
        result["table"] = format_table(metrics, server, title=title)
        return result
    prompts = MixedPrompts(
        ids,
        config.seed,
        (config.mixed_input_len, config.mixed_output_len),
        (config.long_input_len, config.long_output_len),
    )
    await warm_up(session, target, prompts.short(0), config.num_warmup, count_tokens)
    meter.start()
    mixed = await run_mixed(
        lambda request: send_request(session, target, request, count_tokens),
        prompts,
        config.mixed_streams,
        config.mixed_duration_s,
        config.progress,
    )
    server = meter.stop() if pids else None
    result = mixed_result(mixed, _settings(config, base_url, model), server)
    result["table"] = title + "\n" + result["table"]
    return result
