"""Output tok/s of one pdserve stack at several concurrencies, and the per-token streaming overhead.

    .venv/bin/python scripts/bench_scaling.py MODEL_DIR [--mode disaggregated] [--concurrency 1,8,32,64] [--compile]

Starts `pdserve up` once (HTTP front on), runs `pdserve bench` (64 prompt + 64 output tokens,
greedy, EOS ignored) at each concurrency, and reads the decode's own step time from its metrics:
the duration of the steps weighted by their rows, i.e. the mean step time a generated token saw.
The streaming overhead is what the client's TPOT adds to that step time: everything
between the engine sampling a token and the client receiving it (decode servicer, gRPC, gateway,
detokenization, HTTP), and the time a request waits between its first token and its first decode
step (KV pull, admission). The steady-state figure compares the client's median inter-token
latency with the same step time instead.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

PDSERVE = [sys.executable, "-m", "pdserve"]


def scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--mode", default="disaggregated")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="pdserve up --compile")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    up = subprocess.Popen(
        [
            *PDSERVE,
            "up",
            "--model",
            args.model,
            "--mode",
            args.mode,
            "--port",
            "0",
            "--http-port",
            "0",
            *(["--compile"] if args.compile else []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    rows = []
    try:
        assert up.stdout is not None
        ready = json.loads(up.stdout.readline())
        http = ready["gateway"]["http"]
        decode_metrics = ready["decode"][0]["metrics"]
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            before = scrape(decode_metrics)
            done = subprocess.run(
                [
                    *PDSERVE,
                    "bench",
                    "--base-url",
                    f"http://{http}",
                    "--num-prompts",
                    str(max(2 * concurrency, 16)),
                    "--concurrency",
                    str(concurrency),
                    "--input-len",
                    str(args.input_len),
                    "--output-len",
                    str(args.output_len),
                    "--temperature",
                    "0",
                    "--ignore-eos",
                    "--num-warmup",
                    "1",
                    "--json",
                    "--progress",
                    "false",
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            after = scrape(decode_metrics)
            result = json.loads(done.stdout)
            tokens = (
                after["pdserve_decode_generated_tokens_total"]
                - before["pdserve_decode_generated_tokens_total"]
            )
            row_seconds = (
                after["pdserve_decode_row_step_seconds_total"]
                - before["pdserve_decode_row_step_seconds_total"]
            )
            step_ms = 1000 * row_seconds / tokens  # the step time a generated token saw
            metrics = result
            tpot = metrics["tpot_ms"]["mean"]
            itl = metrics["itl_ms"]["p50"]
            rows.append(
                {
                    "concurrency": concurrency,
                    "output_tok_s": round(metrics["output_throughput"], 1),
                    "ttft_p50_ms": round(metrics["ttft_ms"]["p50"], 1),
                    "tpot_mean_ms": round(tpot, 2),
                    "decode_step_ms": round(step_ms, 2),
                    "streaming_overhead_pct": round(100 * (tpot - step_ms) / tpot, 1),
                    "itl_p50_ms": round(itl, 2),
                    "steady_overhead_pct": round(100 * (itl - step_ms) / itl, 1),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
