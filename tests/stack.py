"""Real pdserve processes on 127.0.0.1 for tests: each service started as `python -m pdserve ...`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.config.backend_line import backend_line
from pdserve.rpc.channel_security import INTERNAL_TOKEN_KEY, ChannelSecurity

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 180.0
# Every service the tests start shares this internal token; the tests' own calls carry it.
TEST_TOKEN = "pdserve-test-internal-token"
INTERNAL = ChannelSecurity(((INTERNAL_TOKEN_KEY, TEST_TOKEN),))


def internal_aio_channel(address: str) -> grpc.aio.Channel:
    """A grpc.aio channel whose calls carry the tests' internal token (any pdserve service)."""
    return INTERNAL.aio_channel(address)


def internal_channel(address: str) -> grpc.Channel:
    """A blocking channel whose calls carry the tests' internal token."""
    return INTERNAL.channel(address)


@dataclass
class ServiceProcess:
    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    # What runs ``name``: `python -m pdserve NAME ...` unless another module stands in front of it.
    launcher: tuple[str, ...] = ("-m", "pdserve")
    # A pipe to its stdin (a gateway given --backends-from-stdin reads its backends from it).
    pipe_stdin: bool = False
    popen: subprocess.Popen[str] | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    _ready_event: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        self._ready_event.clear()
        self.ready = {}
        log = self.log_path.open("a")
        self.popen = subprocess.Popen(
            [sys.executable, *self.launcher, self.name, *self.args],
            stdin=subprocess.PIPE if self.pipe_stdin else None,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=self.env,
            cwd=REPO_ROOT,
        )
        threading.Thread(target=self._read_stdout, args=(self.popen,), daemon=True).start()

    def _read_stdout(self, popen: subprocess.Popen[str]) -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(message, dict) and message.get("ready"):
                self.ready = message
                self._ready_event.set()

    def write_stdin(self, text: str) -> None:
        """Writes ``text`` to its stdin (``pipe_stdin``) and closes it."""
        assert self.popen is not None and self.popen.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it exited: wait_ready says how
            self.popen.stdin.write(text)
            self.popen.stdin.close()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while not self._ready_event.wait(0.1):
            assert self.popen is not None
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode}; log:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout_s}s; log:\n{self.log_tail()}")
        return self.ready

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text()[-num_chars:] if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def grpc(self) -> str:
        return str(self.ready["grpc"])

    @property
    def metrics(self) -> str:
        return str(self.ready["metrics"])

    @property
    def rank_metrics(self) -> list[str]:
        """The metrics address of every rank (one, without expert parallelism)."""
        ranks = self.ready.get("ranks")
        return [str(r["metrics"]) for r in ranks] if ranks else [self.metrics]

    @property
    def rank_pids(self) -> list[int]:
        ranks = self.ready.get("ranks")
        return [int(r["pid"]) for r in ranks] if ranks else [self.pid]

    def signal(self, sig: int) -> None:
        assert self.popen is not None
        self.popen.send_signal(sig)

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.popen is None or self.popen.poll() is not None:
            return self.popen.returncode if self.popen else None
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
            return None


def service_env(cache_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(
        PDSERVE_CACHE_DIR=str(cache_dir),
        PDSERVE_INTERNAL_TOKEN=TEST_TOKEN,
        # Eager forwards unless a test asks for --compile: compiling costs a start-up a minute cold.
        PDSERVE_COMPILE="false",
        # A prefix cache of 65536 tokens unless a test sizes it: a prefill writes its whole cache at
        # start, and the default (1/16 of the memory) is gigabytes for every stack a test keeps up.
        PDSERVE_PREFIX_CACHE_TOKENS="65536",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


class Stack:
    """One gateway, N prefills and M decodes of one model, as separate OS processes."""

    def __init__(
        self,
        model: str,
        cache_dir: Path,
        log_dir: Path,
        num_prefill: int = 1,
        num_decode: int = 1,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        gateway_args: Sequence[str] = (),
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        env = service_env(cache_dir)
        common = ["--model", model, "--host", "127.0.0.1"]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.prefills = [
            ServiceProcess("prefill", [*common, *prefill_args], env, log_dir / f"prefill{i}.log")
            for i in range(num_prefill)
        ]
        self.decodes = [
            ServiceProcess("decode", [*common, *decode_args], env, log_dir / f"decode{i}.log")
            for i in range(num_decode)
        ]
        # No HTTP unless asked for (its default port, 8000, is one for all the tests' gateways).
        self._gateway_args = [*common, "--port", "0", "--http-port", "-1", *gateway_args]
        self._env = env
        self._log_dir = log_dir
        self._ready_timeout_s = ready_timeout_s
        self.gateway: ServiceProcess | None = None

    def start(self) -> Stack:
        # As `pdserve up` does: the gateway loads its model beside the replicas and takes their
        # addresses on stdin once they are ready.
        self.gateway = ServiceProcess(
            "gateway",
            [*self._gateway_args, "--backends-from-stdin", "true"],
            self._env,
            self._log_dir / "gateway.log",
            pipe_stdin=True,
        )
        for service in (*self.prefills, *self.decodes, self.gateway):
            service.start()
        try:
            for service in (*self.prefills, *self.decodes):
                service.wait_ready(self._ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.gateway.write_stdin(
            backend_line([p.grpc for p in self.prefills], [d.grpc for d in self.decodes])
        )
        self.gateway.wait_ready()
        return self

    @property
    def address(self) -> str:
        assert self.gateway is not None
        return self.gateway.grpc

    def stop(self) -> None:
        services = [*([self.gateway] if self.gateway else []), *self.decodes, *self.prefills]
        for service in services:
            service.stop()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(address: str) -> dict[str, float]:
    """Prometheus samples of a metrics endpoint, keyed by name{labels} (labels sorted)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def wait_for(predicate: Any, timeout_s: float = 10.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
