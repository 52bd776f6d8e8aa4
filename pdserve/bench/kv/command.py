"""``pdserve bench-kv``: how fast a KV cache moves from a prefill process to a decode process.

Two processes, the real transport: this process is the prefill side (rank 0,
``pdserve.bench.kv.sender``) and spawns the decode side (rank 1, ``pdserve.bench.kv.peer``). For
each size the prefill side packs a cache of the configured shape into one buffer with the real KV
layout, then measures:
- ``memcpy_gbps``: ``copy_`` of the same bytes within that process, into a warm buffer;
- ``transfer_gbps``: the bytes over a PairChannel between the two processes, into a warm buffer
  (from the send being posted, the receive already waiting, to the last byte in);
- ``peer_memcpy_gbps`` and ``transfer_to_peer_memcpy``: the decode side copies as many bytes
  within its own process right before each transfer, and the ratio is taken run by run (median of
  the per-run ratios), so that a machine whose load changes during a run compares the transfer
  with a copy made under the same load (``transfer_to_memcpy`` compares medians of two phases);
- the handoff through the real path: a ``KvHandoffServicer`` (PullKv over gRPC, registry, sender)
  on one side and a ``KvPuller`` on the other, into a fresh buffer as a decode does. The handle
  travels to the decode side in a gRPC call, as the gateway's Decode call carries it: ``hop_ms``
  is that call's way there, ``control_ms`` the puller's handle check, pull call and receive
  posting, ``data_ms`` from the receive posted to every byte in. ``handoff_ms`` = ``pack_ms`` +
  2 x hop (the prefill's answer to the gateway, the gateway's call to the decode) + control +
  data: from the prefill's forward done to the decode's first step being able to run;
- ``intact``: digests of what arrived on both paths equal the digests of what was sent.
Each figure is the median of ``--repeat`` runs after one warm-up run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from pdserve.bench.kv.config import BenchKvConfig
from pdserve.config import flags
from pdserve.core.nccl import configure_error_handling
from pdserve.rpc.server import event_loop_factory

FIELDS = (
    ("tokens", "tokens", "{:d}"),
    ("MiB", "mib", "{:.1f}"),
    ("pack ms", "pack_ms", "{:.2f}"),
    ("memcpy GB/s", "memcpy_gbps", "{:.2f}"),
    ("transfer GB/s", "transfer_gbps", "{:.2f}"),
    ("ratio", "transfer_to_memcpy", "{:.2f}"),
    ("paired ratio", "transfer_to_peer_memcpy", "{:.2f}"),
    ("hop ms", "hop_ms", "{:.3f}"),
    ("control ms", "control_ms", "{:.3f}"),
    ("data ms", "data_ms", "{:.2f}"),
    ("handoff ms", "handoff_ms", "{:.2f}"),
    ("intact", "intact", "{}"),
)


def add_bench_kv_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_arguments(parser, BenchKvConfig)


def run_bench_kv(args: argparse.Namespace) -> int:
    """0 when every size arrived intact, 1 when one did not, 2 on bad flags."""
    config = flags.build_or_report(BenchKvConfig, args, "pdserve bench-kv")
    if config is None:
        return 2
    results: list[dict[str, Any]] = []

    def emit(result: dict[str, Any]) -> None:
        results.append(result)
        if config.json:
            print(json.dumps(result), flush=True)

    from pdserve.bench.kv.sender import run

    configure_error_handling()  # the peer process inherits it
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:  # the services' event loop
        runner.run(run(config, emit))
    if not config.json:
        print(format_table(config, results))
    return 0 if all(r["intact"] for r in results) else 1


def format_table(config: BenchKvConfig, results: list[dict[str, Any]]) -> str:
    layout = config.layout()
    lines = [
        f"KV of {layout.num_layers} layers x {config.kv_heads} heads x {config.head_dim} dims, {config.dtype}: "
        f"{layout.bytes_per_token() / 1024:.0f} KiB per token; backend {config.backend_name}, "
        f"device {config.device} -> {config.receiver_device}; median of {config.repeat} runs",
        "  ".join(f"{title:>13}" for title, _, _ in FIELDS),
    ]
    for result in results:
        lines.append("  ".join(f"{fmt.format(result[key]):>13}" for _, key, fmt in FIELDS))
    return "\n".join(lines)
