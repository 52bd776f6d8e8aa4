"""The `pdserve` command: run the stack or one service, send requests, check health."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.config import ColocatedConfig, DecodeConfig, GatewayConfig, PrefillConfig, flags

SERVICES: dict[str, tuple[type, str]] = {
    "prefill": (PrefillConfig, "run a prefill service"),
    "decode": (DecodeConfig, "run a decode service"),
    "gateway": (GatewayConfig, "run the gateway (public gRPC API)"),
    "colocated": (ColocatedConfig, "run prefill and decode in one process (no KV transfer)"),
}


def _serve(name: str, config: Any) -> None:
    from pdserve.rpc.server import run_service

    if name == "prefill":
        from prefill_service.server import serve as serve_prefill

        run_service(lambda: serve_prefill(config))
    elif name == "decode":
        from decode_service.server import serve as serve_decode

        run_service(lambda: serve_decode(config))
    elif name == "colocated":
        from colocated_service.server import serve as serve_colocated

        run_service(lambda: serve_colocated(config))
    else:
        from gateway.server import serve as serve_gateway

        run_service(lambda: serve_gateway(config))


def build_parser() -> argparse.ArgumentParser:
    from pdserve import client
    from pdserve.bench import command as bench
    from pdserve.launch import supervisor as launcher
    from pdserve.rpc import health_client

    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__, allow_abbrev=False)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = commands.add_parser("up", help="run gateway, prefill and decode as separate processes")
    launcher.add_up_arguments(up)
    up.set_defaults(run=launcher.run_up_from_args)

    for name, (cls, help_text) in SERVICES.items():
        sub = commands.add_parser(name, help=help_text)
        flags.add_arguments(sub, cls)
        sub.set_defaults(run=_service_runner(name, cls))

    generate = commands.add_parser("generate", help="stream one request from a running gateway")
    client.add_generate_arguments(generate)
    generate.set_defaults(run=client.run_generate)

    health = commands.add_parser("health", help="exit 0 when a service reports SERVING")
    health_client.add_health_arguments(health)
    health.set_defaults(run=health_client.run_health)

    from pdserve.bench.kv import command as bench_kv

    bench_kv_parser = commands.add_parser("bench-kv", help="measure the KV handoff between two processes")
    bench_kv.add_bench_kv_arguments(bench_kv_parser)
    bench_kv_parser.set_defaults(run=bench_kv.run_bench_kv)

    bench_parser = commands.add_parser("bench", help="benchmark an OpenAI-compatible server")
    bench.add_bench_arguments(bench_parser)
    bench_parser.set_defaults(run=bench.run_bench)
    for sub in commands.choices.values():
        sub.allow_abbrev = False  # `up --mode` must never be read as `--model`
    return parser


def _service_runner(name: str, cls: type) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        config: Any = flags.build_or_report(cls, args, f"pdserve {name}")
        if config is None:
            return 2
        # Secure by default: no service calls or serves the internal API without the token.
        security = config.internal if name == "gateway" else config.security
        try:
            security.require_token(f"pdserve {name}")
        except ValueError as error:
            print(f"pdserve {name}: error: {error}", file=sys.stderr)
            return 2
        _serve(name, config)
        return 0

    return run


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except ValueError as exc:
        parser.error(str(exc))
    sys.exit(args.run(args))
