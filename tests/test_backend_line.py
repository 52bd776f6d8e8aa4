"""A gateway started before its backends (``--backends-from-stdin``): the line that hands it their
addresses, checked as the flags are, and a real gateway that serves once it has read it (every stack of
the tests starts its gateway so) or exits with one error line when the line is wrong."""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.config import GatewayConfig
from pdserve.config.backend_line import backend_line, read_backend_line, with_backend_line
from tests.stack import service_env

WAITING = GatewayConfig(backends_from_stdin=True)


def test_the_line_sets_the_addresses_as_the_flags_would() -> None:
    line = backend_line(["127.0.0.1:1", "dns:///prefill:2"], ["[::1]:3"])
    assert line.endswith("\n") and line.count("\n") == 1
    config = with_backend_line(WAITING, line)
    assert config == GatewayConfig(prefill=("127.0.0.1:1", "dns:///prefill:2"), decode=("[::1]:3",))


def test_read_from_a_stream() -> None:
    stream = io.StringIO(backend_line(["h:1"], ["h:2"]) + "ignored\n")
    config = asyncio.run(read_backend_line(WAITING, stream))
    assert (config.prefill, config.decode, config.backends_from_stdin) == (("h:1",), ("h:2",), False)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("", "stdin ended"),
        ("h:1,h:2\n", "not JSON"),
        ('["h:1"]\n', "must be"),
        ('{"prefill": ["h:1"]}\n', "must be"),
        ('{"prefill": ["h:1"], "decode": "h:2"}\n', "must be"),
        ('{"prefill": ["h:1"], "decode": [2]}\n', "must be"),
        ('{"prefill": ["h:1"], "decode": ["h:2"], "extra": []}\n', "must be"),
        ('{"prefill": [], "decode": ["h:2"]}\n', "at least one prefill"),
        ('{"prefill": ["h:1"], "decode": []}\n', "at least one decode"),
        ('{"prefill": ["h"], "decode": ["h:2"]}\n', "prefill"),
        ('{"prefill": ["h:1"], "decode": ["dns://x/h:2"]}\n', "decode"),
    ],
)
def test_a_wrong_line_says_what_is_wrong(line: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        with_backend_line(WAITING, line)


def test_the_flags_and_stdin_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="set neither"):
        GatewayConfig(backends_from_stdin=True, prefill=("h:1",))
    with pytest.raises(ValueError, match="at least one prefill"):
        GatewayConfig(decode=("h:2",))


def test_a_gateway_handed_a_wrong_line_exits_with_one_error_line(cache_dir: Path) -> None:
    argv = [sys.executable, "-m", "pdserve", "gateway", "--model", "tiny-llama", "--host", "127.0.0.1"]
    argv += ["--port", "0", "--http-port", "-1", "--backends-from-stdin"]
    done = subprocess.run(
        argv,
        input='{"prefill": ["127.0.0.1:1"]}\n',
        env=service_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "--backends-from-stdin" in done.stderr and "must be" in done.stderr
    assert "Traceback" not in done.stderr
    assert '"ready"' not in done.stdout
