"""Single-process `model.generate` throughput: the in-process baseline of the serving benchmark.

    .venv/bin/python scripts/bench_generate.py MODEL_DIR --batch 32 --input-len 64 --output-len 64

Runs one warm-up and then greedy generation of a batch of random prompts with EOS ignored, on one
intra-op thread unless --threads says otherwise, and prints one JSON line with output tok/s.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.input_len), generator=generator)

    def run(num_tokens: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - started

    run(2)
    elapsed = run(args.output_len)
    print(
        json.dumps(
            {
                "batch": args.batch,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "seconds": round(elapsed, 3),
                "output_tok_s": round(args.batch * args.output_len / elapsed, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
