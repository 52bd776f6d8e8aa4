"""Decode tok/s of a DeepSeekMoE model through pdserve's DecodeEngine against `model.generate`, in one run.

    .venv/bin/python scripts/bench_moe_decode.py                                  # 16B shapes, cuda:0, bf16
    .venv/bin/python scripts/bench_moe_decode.py --model tiny-deepseek-moe --device cpu --batch 1,4 \\
        --input-len 16 --output-len 8 --json                                        # CPU smoke run

Per batch size, the same random prompts go both ways, greedy with EOS ignored:
- pdserve: the prompts are prefilled by a PrefillEngine (first token and packed KV, as a prefill
  parks them), the KV is unpacked from that buffer as a colocated decode takes it and submitted to a
  DecodeEngine with a KvPool; the timed part runs from the engine's start to the last token of the
  batch (admission's KV copy included): batch * (output_len - 1) tokens, the first came from prefill.
- `model.generate`: decode tok/s = batch * (output_len - 1) / (t(output_len new tokens) - t(1 new
  token)), so both sides count the same steps; `generate_tok_s` is the plain end-to-end rate.
Each side runs one untimed warm-up of the batch first. `match` counts rows whose tokens agree.

The `deepseek-moe-16b-shape` preset (random weights, about 16B parameters, 33 GB in bfloat16) is
built directly on the device, never written to disk; other presets and model directories are loaded
as an engine loads them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from prometheus_client import CollectorRegistry
from transformers import AutoModelForCausalLM

from decode_service.engine import DecodeEngine
from decode_service.kv_pool import KvPool
from decode_service.metrics import DecodeMetrics
from decode_service.sequence import DecodeSequence, Emission, EmitFn
from pdserve.config import EngineConfig
from pdserve.core.limits import ModelLimits
from pdserve.core.sampling import SamplingParams
from pdserve.kv.layout import unpack
from pdserve.model.engine_model import EngineModel, load_engine_model, measure_kv_layout, resolve_dtype
from pdserve.model.source import DEEPSEEK_MOE_16B_SHAPE
from prefill_service.engine import PrefillEngine, PrefillResult

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Row:
    batch: int
    pdserve_decode_tok_s: float
    pdserve_step_ms: float
    generate_decode_tok_s: float
    generate_step_ms: float
    generate_tok_s: float
    speedup: float  # pdserve over generate, decode tok/s
    match: int  # rows whose greedy tokens are the same both ways


def build_model(args: argparse.Namespace) -> EngineModel:
    """The engine model: the 16B-shape preset drawn on the device, anything else loaded from disk."""
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    else:
        torch.cuda.set_device(device)
    if args.model != DEEPSEEK_MOE_16B_SHAPE:
        engine = EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            threads=args.threads,
            cache_dir=args.cache_dir,
        )
        return load_engine_model(engine)
    from pdserve.model.presets.tiny import tiny_config
    from pdserve.model.presets.tiny_tokenizer import EOS_TOKEN, build_tokenizer

    tokenizer = build_tokenizer(model_max_length=4096)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = tiny_config(args.model, len(tokenizer), eos_id)
    dtype = resolve_dtype(args.dtype, device, config)
    torch.manual_seed(args.seed)
    with torch.device(device):  # every parameter and buffer is created (and initialized) there
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return EngineModel(
        model=model,
        tokenizer=tokenizer,
        limits=ModelLimits.from_config(config, 0, frozenset({eos_id})),
        device=device,
        fingerprint=f"random-{args.model}-{args.seed}",
        kv_layout=measure_kv_layout(model, device),
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(m: EngineModel, prompts: torch.Tensor, params: SamplingParams) -> list[PrefillResult]:
    """The prompts through a PrefillEngine, as a prefill service runs them (one batch)."""
    engine = PrefillEngine(m, m.device, max_batch_tokens=prompts.numel())

    async def run_all() -> list[PrefillResult]:
        return list(await asyncio.gather(*(engine.run(p, params) for p in prompts.tolist())))

    try:
        results = asyncio.run(run_all())
    finally:
        engine.close()
    if any(r.kv_buffer is None for r in results):
        raise RuntimeError("a prompt finished at its first token; the benchmark needs output_len >= 2")
    return results


def decode(
    m: EngineModel, pool: KvPool, prefilled: Sequence[PrefillResult], max_tokens: int
) -> tuple[float, list[list[int]]]:
    """Seconds from the engine's start to the batch's last token, and each row's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = [[r.first_token_id] for r in prefilled]
    errors: list[BaseException] = []
    remaining = [len(prefilled)]
    done = threading.Event()

    def emitter(row: int) -> EmitFn:
        def emit(emission: Emission) -> None:
            tokens[row].extend(emission.token_ids)
            if emission.error is not None:
                errors.append(emission.error)
            if emission.is_last:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()

        return emit

    engine = DecodeEngine(m, DecodeMetrics(CollectorRegistry()), len(prefilled), pool)
    for row, result in enumerate(prefilled):
        assert result.kv_buffer is not None
        kv = unpack(result.kv_buffer, m.kv_layout, result.num_tokens)
        engine.submit(DecodeSequence(f"bench-{row}", kv, result.first_token_id, params, emitter(row)))
    synchronize(m.device)
    started = time.perf_counter()
    engine.start()  # every request is waiting already: the first step runs the whole batch
    done.wait()
    synchronize(m.device)
    elapsed = time.perf_counter() - started
    engine.stop()
    if errors:
        raise RuntimeError(f"decode failed: {errors[0]}") from errors[0]
    if pool.num_used_blocks:
        raise RuntimeError(f"{pool.num_used_blocks} KV blocks still in use after the batch")
    return elapsed, tokens


def generate(m: EngineModel, prompts: torch.Tensor, new_tokens: int) -> tuple[float, list[list[int]]]:
    pad = next(iter(m.limits.eos_token_ids), 0)
    synchronize(m.device)
    started = time.perf_counter()
    with torch.inference_mode():
        out = m.model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad,
        )
    synchronize(m.device)
    elapsed = time.perf_counter() - started
    if out.shape[1] != prompts.shape[1] + new_tokens:
        raise RuntimeError(f"generate returned {out.shape[1] - prompts.shape[1]} of {new_tokens} new tokens")
    return elapsed, out[:, prompts.shape[1] :].tolist()


def bench_batch(m: EngineModel, pool: KvPool, args: argparse.Namespace, batch: int) -> Row:
    generator = torch.Generator(device="cpu").manual_seed(args.seed + batch)
    prompts_cpu = torch.randint(0, m.limits.vocab_size, (batch, args.input_len), generator=generator)
    prompts = prompts_cpu.to(m.device)
    steps = args.output_len - 1
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    prefilled = prefill(m, prompts_cpu, params)
    decode(m, pool, prefilled, min(args.output_len, args.warmup_tokens))  # warm-up
    decode_s, ours = decode(m, pool, prefilled, args.output_len)
    generate(m, prompts, min(args.output_len, args.warmup_tokens))  # warm-up
    first_s, _ = generate(m, prompts, 1)
    full_s, reference = generate(m, prompts, args.output_len)
    generate_decode_s = max(full_s - first_s, 1e-9)
    return Row(
        batch=batch,
        pdserve_decode_tok_s=round(batch * steps / decode_s, 2),
        pdserve_step_ms=round(1000 * decode_s / steps, 3),
        generate_decode_tok_s=round(batch * steps / generate_decode_s, 2),
        generate_step_ms=round(1000 * generate_decode_s / steps, 3),
        generate_tok_s=round(batch * args.output_len / full_s, 2),
        speedup=round(generate_decode_s / decode_s, 3),
        match=sum(a == b for a, b in zip(ours, reference, strict=True)),
    )


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| batch | pdserve decode tok/s | step ms | generate decode tok/s | step ms | generate e2e tok/s "
        "| pdserve / generate | rows matching |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.batch} | {r.pdserve_decode_tok_s:.1f} | {r.pdserve_step_ms:.2f} | {r.generate_decode_tok_s:.1f}"
            f" | {r.generate_step_ms:.2f} | {r.generate_tok_s:.1f} | {r.speedup:.2f}x | {r.match}/{r.batch} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEEPSEEK_MOE_16B_SHAPE, help="preset name or model directory")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", default="auto", help="auto: float32 on CPU, the model's (bfloat16) on CUDA"
    )
    parser.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--warmup-tokens", type=int, default=8, help="new tokens of each warm-up run")
    parser.add_argument("--experts-implementation", default=None, help="eager, batched_mm, grouped_mm, …")
    parser.add_argument("--threads", type=int, default=1, help="intra-op torch threads on CPU")
    parser.add_argument("--cache-dir", default="", help="where presets other than the 16B shape are built")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object (the table goes to stderr)"
    )
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batch.split(",") if b]
    if not args.batches or min(args.batches) < 1:
        parser.error(f"--batch needs positive sizes, got {args.batch!r}")
    if args.input_len < 1 or args.output_len < 2 or args.warmup_tokens < 2:
        parser.error("--input-len must be >= 1, --output-len and --warmup-tokens >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_grad_enabled(False)
    started = time.perf_counter()
    m = build_model(args)
    if args.experts_implementation:
        m.model.set_experts_implementation(args.experts_implementation)
    build_s = time.perf_counter() - started
    n_params = sum(p.numel() for p in m.model.parameters())
    per_row = -(-(args.input_len + args.output_len) // BLOCK_SIZE)
    pool = KvPool(m.kv_layout, per_row * max(args.batches), BLOCK_SIZE, m.device)
    rows = [bench_batch(m, pool, args, batch) for batch in args.batches]
    result: dict[str, Any] = {
        "model": args.model,
        "parameters": n_params,
        "device": str(m.device),
        "device_name": torch.cuda.get_device_name(m.device) if m.device.type == "cuda" else "cpu",
        "dtype": str(m.kv_layout.dtype).removeprefix("torch."),
        "experts_implementation": m.model.config._experts_implementation,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "build_seconds": round(build_s, 2),
        "max_memory_gib": round(torch.cuda.max_memory_allocated(m.device) / 2**30, 2)
        if m.device.type == "cuda"
        else None,
        "rows": [asdict(r) for r in rows],
    }
    header = (
        f"{args.model} ({n_params / 1e9:.3g}B parameters, {result['dtype']}, experts "
        f"{result['experts_implementation']}) on {result['device_name']}: prompts of {args.input_len}, "
        f"{args.output_len} new tokens, greedy, EOS ignored"
    )
    out = sys.stderr if args.json else sys.stdout
    print(header, table(rows), sep="\n", file=out, flush=True)
    if args.json:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
