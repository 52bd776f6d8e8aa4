"""Times a model's compiled forwards on a CPU by how its linear layers multiply: packed by oneDNN with
the operator's C++ kernel (what an engine loads), packed with its Python kernel (where no compiler
built the C++ one), and plain weights stored input-major (MKL's GEMM). One thread, float32, inductor
with its C++ wrapper as the engines compile; each layout in a process of its own (a loaded kernel
stays loaded). Medians of ``--repeats`` forwards of new tokens over a 64-token cache, for three
shapes: 16 rows of one token (a decode step), 3 rows of 32 (prompts after a cached prefix), one row
of one; then the same while another thread of the process runs Python (as a service's event loop
does beside its engine).

    .venv/bin/python scripts/bench_packed_linear.py /tmp/pdserve-peers/reference-model
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pdserve.model import packed_linear
from pdserve.model.weight_layout import store_linear_weights_input_major

LAYOUTS = ("packed-cpp", "packed-python", "input-major")
SHAPES = ((16, 1), (3, 32), (1, 1))
CONTEXT = 64


def _median_ms(model: torch.nn.Module, forward: object, rows: int, tokens: int, repeats: int) -> float:
    vocab = int(model.config.vocab_size)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.randint(0, vocab, (rows, CONTEXT)), cache=cache, use_cache=True)
            new = torch.randint(0, vocab, (rows, tokens))
            start = time.perf_counter()
            forward(input_ids=new, cache=cache, use_cache=True)  # type: ignore[operator]
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(model_dir: str, layout: str, repeats: int) -> str:
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if layout == "packed-cpp":
        with tempfile.TemporaryDirectory() as cache:
            if not packed_linear.load(Path(cache)):
                return f"{layout}: the C++ kernel did not build"
    if layout.startswith("packed"):
        packed_linear.pack_linear_weights(model)
    else:
        store_linear_weights_input_major(model)
    forward = torch.compile(model, dynamic=True, options={"cpp_wrapper": True})
    for rows, tokens in SHAPES:  # compiles
        _median_ms(model, forward, rows, tokens, 2)
    idle = [_median_ms(model, forward, rows, tokens, repeats) for rows, tokens in SHAPES]
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    busy = [_median_ms(model, forward, rows, tokens, repeats) for rows, tokens in SHAPES]
    stop.set()
    spinner.join()
    cells = "  ".join(f"{r}x{t} {a:6.2f} / {b:7.2f}" for (r, t), a, b in zip(SHAPES, idle, busy, strict=True))
    return f"{layout:13s}  {cells}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="a model directory (the reference model of PEERS.md)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--layout", choices=LAYOUTS, help="measure one layout in this process")
    args = parser.parse_args()
    if args.layout:
        print(measure(args.model, args.layout, args.repeats), flush=True)
        return
    print("layout         rows x tokens: median ms, idle / another thread running Python")
    for layout in LAYOUTS:
        command = [sys.executable, __file__, args.model, "--layout", layout, "--repeats", str(args.repeats)]
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
