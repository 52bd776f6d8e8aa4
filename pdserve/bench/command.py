"""The ``pdserve bench`` command: flags, an optional launched server, the run and its report.

Flags (and ``PDSERVE_*`` variables) become a ``BenchConfig``. With ``--launch MODEL`` a
``pdserve up`` is started for the run, its HTTP front becomes the base URL and its process tree
the server whose CPU seconds are measured; otherwise ``--server-pid`` names the server's
processes. A table (or ``--json``) goes to stdout; ``--output-file`` also keeps the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from contextlib import ExitStack
from pathlib import Path

from pdserve.bench.config import BenchConfig
from pdserve.config import flags
from pdserve.core.logs import configure_logging


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``BenchConfig`` field; boolean flags also work bare (``--json``)."""
    flags.add_arguments(parser, BenchConfig)


def run_bench(args: argparse.Namespace) -> int:
    """``pdserve bench``: 0 when at least one request completed, 1 otherwise, 2 on bad flags."""
    config = flags.build_or_report(BenchConfig, args, "pdserve bench")
    if config is None:
        return 2
    import aiohttp

    from pdserve.bench.benchmark import run_benchmark
    from pdserve.bench.launch import LaunchedServer

    configure_logging("WARNING")
    pids = [int(pid) for pid in config.server_pid]
    try:
        with ExitStack() as stack:
            base_url = config.base_url.rstrip("/")
            if config.launch:
                server = stack.enter_context(
                    LaunchedServer(config.launch, config.mode, config.launch_timeout_s)
                )
                base_url = server.base_url
                pids.append(server.pid)
            result = asyncio.run(run_benchmark(config, base_url, pids))
    except (RuntimeError, ValueError, OSError, aiohttp.ClientError) as error:
        print(f"pdserve bench: {error}", file=sys.stderr)
        return 1
    table = result.pop("table")
    if config.output_file:
        Path(config.output_file).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if config.json else table)
    return 0 if result["completed"] else 1
