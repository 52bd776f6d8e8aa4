"""Times the CPU decode-attention operator (``pdserve::decode_attention``) on a batch context whose rows
have different lengths: the mask leaves out each row's positions past its own length, as a decode
step's does. One thread, float32, the reference model's heads (4 of 64); medians of ``--calls``
calls, with the mask, with every position attended, and with no mask.

    .venv/bin/python scripts/bench_decode_attention.py --rows 16 --shortest 64 --step 8
    .venv/bin/python scripts/bench_decode_attention.py --source /tmp/old/decode_attention.cpp

``--source`` builds and loads another version of the operator's C++ source (one version per process:
each registers the same operator), to compare kernels in alternating processes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.model import cpu_kernel, decode_attention

HEADS, WIDTH = 4, 64


def _median_us(
    mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, calls: int
) -> float:
    op = torch.ops.pdserve.decode_attention
    for _ in range(3):
        op(query, key, value, mask, WIDTH**-0.5)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        op(query, key, value, mask, WIDTH**-0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--shortest", type=int, default=64, help="positions of the first row")
    parser.add_argument("--step", type=int, default=8, help="positions each next row has more")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--source", type=Path, default=decode_attention.SOURCE)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as cache:
        if not cpu_kernel.load(args.source, Path(cache), "decode attention kernel", "nothing to time"):
            raise SystemExit(f"{args.source} did not build")
    lengths = torch.tensor([args.shortest + args.step * i for i in range(args.rows)])
    positions = int(lengths.max()) + 1  # a step's context: the longest row's length and its new position
    context = torch.randn(args.rows, positions, HEADS, 2 * WIDTH)  # [rows, positions, heads, keys|values]
    key, value = context[..., :WIDTH].transpose(1, 2), context[..., WIDTH:].transpose(1, 2)
    query = torch.randn(args.rows, HEADS, 1, WIDTH)
    beyond = torch.arange(positions)[None, :] > lengths[:, None]
    mask = torch.zeros(args.rows, 1, 1, positions).masked_fill_(
        beyond[:, None, None, :], torch.finfo(torch.float32).min
    )
    attended = torch.zeros_like(mask)
    print(f"{args.rows} rows of {args.shortest}..{int(lengths.max())} positions, a context {positions} wide")
    for _ in range(args.rounds):
        own = _median_us(mask, query, key, value, args.calls)
        every = _median_us(attended, query, key, value, args.calls)
        none = _median_us(None, query, key, value, args.calls)
        print(
            f"µs a call: each row's own positions {own:.0f}, every position attended {every:.0f}, no mask {none:.0f}"
        )


if __name__ == "__main__":
    main()
