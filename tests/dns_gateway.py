"""``pdserve gateway`` whose ``dns:///`` names are answered from a JSON file that a test rewrites.

Usage: ``python -m tests.dns_gateway NAMES_FILE gateway [pdserve gateway flags]``. The file maps a
name to its addresses, ``{"decodes": ["127.0.0.1:1234", ...]}``; a name it lacks has no address.
Everything else is the real gateway (``gateway.server.serve`` with this resolver).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gateway.server import serve
from pdserve.config import GatewayConfig, flags
from pdserve.rpc.server import run_service


class FileResolver:
    def __init__(self, path: Path) -> None:
        self._path = path

    def __call__(self, host: str, port: int) -> list[str]:
        names = json.loads(self._path.read_text())
        return [str(address) for address in names.get(host, [])]


def write_names(path: Path, **names: list[str]) -> None:
    """Replaces what the names resolve to, in one step (a reader never sees half a file)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(names))
    partial.replace(path)


def main() -> None:
    names_file, command, *args = sys.argv[1:]
    assert command == "gateway", command
    parser = argparse.ArgumentParser(prog="dns_gateway")
    flags.add_arguments(parser, GatewayConfig)
    config = flags.build(GatewayConfig, parser.parse_args(args))
    run_service(lambda: serve(config, resolver=FileResolver(Path(names_file))))


if __name__ == "__main__":
    main()
