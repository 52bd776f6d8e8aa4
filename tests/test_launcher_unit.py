"""Unit tests of `pdserve up` (the supervisor) and of the health client.

The supervisor runs small fake child programs (written to tmp_path) instead of the real
services, through its injectable command builder; no model is loaded.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.config import flags
from pdserve.core import processes
from pdserve.launch import spec as launch_spec
from pdserve.launch import supervisor as launcher
from pdserve.launch.spec import LaunchSpec, UpConfig
from pdserve.launch.supervisor import Supervisor
from pdserve.rpc import health_client
from pdserve.v1 import gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.timeout(60)

# A stand-in for `python -m pdserve ROLE ...`: announces a ready line on the ports it was given
# (or free ones), logs each start to --log, and then behaves as --behavior says.
FAKE_CHILD = r"""
import argparse, json, os, signal, socket, sys, time

parser = argparse.ArgumentParser()
parser.add_argument("role")
parser.add_argument("--name", required=True)
parser.add_argument("--log", required=True)
parser.add_argument("--behavior", default="serve")
parser.add_argument("--report-grpc", default="")
parser.add_argument("--port", type=int, default=0)
parser.add_argument("--metrics-port", type=int, default=0)
parser.add_argument("--kv-port", type=int, default=0)
parser.add_argument("--prefill", default="")
parser.add_argument("--decode", default="")
parser.add_argument("--backends-from-stdin", default="false")
args, _ = parser.parse_known_args()


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_go():
    while not os.path.exists(args.log + ".go"):
        time.sleep(0.02)


signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
if args.behavior == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if args.behavior == "die-before-ready":
    sys.exit(3)

print(f"hello from {args.name}", flush=True)
if args.behavior == "never-ready":
    while True:
        time.sleep(1)

backends = {"prefill": args.prefill.split(","), "decode": args.decode.split(",")}
if args.backends_from_stdin == "true":
    backends = json.loads(sys.stdin.readline())

grpc_address = args.report_grpc or f"127.0.0.1:{args.port or free_port()}"
ready = {"ready": True, "service": args.role, "grpc": grpc_address,
         "metrics": f"127.0.0.1:{args.metrics_port or free_port()}", "pid": os.getpid()}
if args.role == "prefill":
    ready["kv_rendezvous"] = f"127.0.0.1:{args.kv_port or free_port()}"
with open(args.log, "a") as log:
    log.write(json.dumps({"name": args.name, "argv": sys.argv[1:], "time": time.monotonic(),
                          "backends": backends, **ready}) + "\n")
print(json.dumps(ready), flush=True)

marker = f"{args.log}.{args.name}.died"
if args.behavior == "die-after-ready" or (args.behavior == "die-once" and not os.path.exists(marker)):
    open(marker, "w").close()
    wait_for_go()
    time.sleep(0.1)
    sys.exit(3)
while True:
    time.sleep(1)
"""

# Runs a Supervisor over the fake children in its own process (for signal tests).
RUNNER = r"""
import json, sys
from pdserve.launch.spec import UpConfig, service_command
from pdserve.launch.supervisor import Supervisor

config = UpConfig(**json.loads(sys.argv[1]))
fake, log, behaviors = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])

def build(spec):
    behavior = behaviors.get(spec.name, "serve")
    return [sys.executable, fake, *service_command(config, spec)[3:],
            "--name", spec.name, "--log", log, "--behavior", behavior]

sys.exit(Supervisor(config, command_builder=build, health_check=None).run())
"""

FAST: dict[str, Any] = {
    "port": 0,
    "http_port": 0,
    "restart_backoff_s": 0.1,
    "startup_timeout_s": 20.0,
    "shutdown_timeout_s": 5.0,
}


class Fakes:
    """Paths of the fake child program and of the log of every start."""

    def __init__(self, root: Path) -> None:
        self.script = root / "fake_child.py"
        self.script.write_text(FAKE_CHILD)
        self.runner = root / "runner.py"
        self.runner.write_text(RUNNER)
        self.log = root / "starts.jsonl"
        self.log.touch()
        self.go = Path(str(self.log) + ".go")

    def builder(
        self, config: UpConfig, behaviors: Mapping[str, str], report_grpc: str = ""
    ) -> Callable[[LaunchSpec], list[str]]:
        def build(spec: LaunchSpec) -> list[str]:
            argv = [sys.executable, str(self.script), *launch_spec.service_command(config, spec)[3:]]
            argv += [
                "--name",
                spec.name,
                "--log",
                str(self.log),
                "--behavior",
                behaviors.get(spec.name, "serve"),
            ]
            if spec.role == launch_spec.GATEWAY and report_grpc:
                argv += ["--report-grpc", report_grpc]
            return argv

        return build

    def starts(self, name: str | None = None) -> list[dict[str, Any]]:
        entries = [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]
        return [entry for entry in entries if name is None or entry["name"] == name]


@pytest.fixture
def fakes(tmp_path: Path) -> Iterator[Fakes]:
    fakes = Fakes(tmp_path)
    yield fakes
    for start in fakes.starts():  # a failed test must not leave children behind
        if is_alive(start["pid"]):
            os.kill(start["pid"], signal.SIGKILL)


def is_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead)."""
    stat = Path(f"/proc/{pid}/stat")
    if Path("/proc/self/stat").exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def all_pids(endpoints: Mapping[str, Any]) -> list[int]:
    services = [endpoints["gateway"], *endpoints["prefill"], *endpoints["decode"]]
    return [int(service["pid"]) for service in services]


class Running:
    """A Supervisor.run() on a background thread, as a test's handle."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor
        self.result: list[int] = []
        self.thread = threading.Thread(target=lambda: self.result.append(supervisor.run()), daemon=True)
        self.thread.start()

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        assert self.supervisor.ready.wait(timeout_s), "the supervisor never printed its ready line"

    def join(self, timeout_s: float = 20.0) -> int:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "Supervisor.run() did not return"
        return self.result[0]

    def stop(self) -> int:
        self.supervisor.request_stop()
        return self.join()


@pytest.fixture
def running() -> Iterator[Callable[[Supervisor], Running]]:
    started: list[Running] = []

    def start(supervisor: Supervisor) -> Running:
        started.append(Running(supervisor))
        return started[-1]

    yield start
    for handle in started:  # never leave children behind, even when a test fails
        if handle.thread.is_alive():
            handle.supervisor.request_stop()
            handle.supervisor.request_stop()
            handle.thread.join(20)


# -- pure helpers -------------------------------------------------------------------------------


def test_parse_ready_line() -> None:
    line = '{"ready": true, "service": "prefill", "grpc": "127.0.0.1:1", "kv_rendezvous": "h:3", "pid": 7}\n'
    assert launch_spec.parse_ready_line(line) == {"grpc": "127.0.0.1:1", "kv_rendezvous": "h:3", "pid": 7}
    assert launch_spec.parse_ready_line("loading weights...\n") is None
    assert launch_spec.parse_ready_line("{not json\n") is None
    assert launch_spec.parse_ready_line('{"ready": false, "grpc": "h:1"}') is None
    assert launch_spec.parse_ready_line('{"ready": true}') is None
    assert launch_spec.parse_ready_line('{"ready": "yes", "grpc": "h:1"}') is None
    assert launch_spec.parse_ready_line("[1, 2]") is None


def test_pin_ports_takes_the_announced_ports() -> None:
    spec = LaunchSpec("prefill", 1)
    info = {"grpc": "127.0.0.1:4001", "metrics": "127.0.0.1:4002", "kv_rendezvous": "127.0.0.1:4003"}
    assert launch_spec.pin_ports(spec, info) == LaunchSpec(
        "prefill", 1, port=4001, metrics_port=4002, kv_port=4003
    )
    assert launch_spec.pin_ports(LaunchSpec("decode"), {"grpc": "[::1]:9"}).port == 9
    assert launch_spec.port_of(None) == 0
    assert launch_spec.port_of("no-port") == 0


def test_service_command() -> None:
    config = UpConfig(model="tiny-llama", device="cpu", threads=2, cache_dir="/tmp/c")
    prefill = launch_spec.service_command(config, LaunchSpec("prefill", 0, port=1, metrics_port=2, kv_port=3))
    assert prefill[:4] == [sys.executable, "-m", "pdserve", "prefill"]
    flags = dict(zip(prefill[4::2], prefill[5::2], strict=True))
    assert flags == {
        "--model": "tiny-llama",
        "--host": "127.0.0.1",
        "--port": "1",
        "--metrics-port": "2",
        "--device": "cpu",
        "--threads": "2",
        "--ep": "1",
        "--kv-backend": "auto",
        "--kv-port": "3",
        "--cache-dir": "/tmp/c",
    }
    decode = launch_spec.service_command(UpConfig(prefill_ep=4, decode_ep=2), LaunchSpec("decode"))
    assert "--kv-port" not in decode and "--cache-dir" not in decode
    assert dict(zip(decode[4::2], decode[5::2], strict=True))["--ep"] == "2"
    colocated = launch_spec.service_command(
        UpConfig(mode="colocated", prefill_ep=2, compile="true"), LaunchSpec("colocated")
    )
    flags = dict(zip(colocated[4::2], colocated[5::2], strict=True))
    assert flags["--ep"] == "2" and flags["--compile"] == "true"
    assert "--compile" not in decode
    assert "--linear-layout" not in decode  # auto: each engine times its own
    pinned = launch_spec.service_command(UpConfig(linear_layout="packed"), LaunchSpec("prefill"))
    assert dict(zip(pinned[4::2], pinned[5::2], strict=True))["--linear-layout"] == "packed"
    gateway = launch_spec.service_command(
        UpConfig(port=8000), LaunchSpec("gateway", port=8000, prefill=("h:1", "h:2"), decode=("h:3",))
    )
    flags = dict(zip(gateway[4::2], gateway[5::2], strict=True))
    assert flags["--prefill"] == "h:1,h:2" and flags["--decode"] == "h:3" and flags["--port"] == "8000"
    assert "--device" not in flags and "--kv-port" not in flags


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_with_parent_death_signal_execs_the_command() -> None:
    argv = [sys.executable, "-c", "import os, sys; print(os.getpid(), sys.argv[1:])", "a b", "--c"]
    wrapped = processes.with_parent_death_signal(argv, os.getpid())
    proc = subprocess.run(wrapped, capture_output=True, text=True, timeout=30, check=True)
    assert proc.stdout.split(" ", 1)[1] == "['a b', '--c']\n"
    # A child whose supervisor is already gone does not start.
    orphan = processes.with_parent_death_signal(argv, 1 if os.getpid() != 1 else 2)
    proc = subprocess.run(orphan, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "supervisor died" in proc.stderr


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": ""},
        {"host": ""},
        {"port": 70000},
        {"device": "tpu"},
        {"threads": 0},
        {"prefill_replicas": 0},
        {"decode_replicas": 0},
        {"max_restarts": -1},
        {"restart_window_s": 0},
        {"restart_backoff_s": 0},
        {"restart_backoff_s": 2.0, "restart_backoff_max_s": 1.0},
        {"startup_timeout_s": 0},
        {"shutdown_timeout_s": -1},
        {"demo": True, "demo_prompt": ""},
        {"prefill_ep": 0},
        {"decode_ep": 0},
        {"mode": "colocated", "prefill_ep": 2, "decode_ep": 3},
    ],
)
def test_up_config_rejects(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        UpConfig(**kwargs)


def test_restart_delay_doubles_and_is_capped() -> None:
    config = UpConfig(restart_backoff_s=1.0, restart_backoff_max_s=5.0)
    assert [config.restart_delay_s(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert config.restart_delay_s(10_000) == 5.0


def test_up_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_DECODE_REPLICAS", "3")
    parser = argparse.ArgumentParser()
    launcher.add_up_arguments(parser)
    args = parser.parse_args(["--demo", "--prefill-replicas", "2", "--port", "0"])
    config = flags.build(UpConfig, args)
    assert config.demo is True
    assert (config.prefill_replicas, config.decode_replicas, config.port) == (2, 3, 0)
    assert flags.build(UpConfig, parser.parse_args(["--demo", "false"])).demo is False
    assert flags.build(UpConfig, parser.parse_args([])).demo is False


def test_run_up_from_args_rejects_a_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    launcher.add_up_arguments(parser)
    assert launcher.run_up_from_args(parser.parse_args(["--max-restarts", "-2"])) == 2
    assert "error: max_restarts must be >= 0" in capsys.readouterr().err


# -- the supervisor over fake children ------------------------------------------------------------


def test_startup_announces_one_ready_line_then_stops_cleanly(
    fakes: Fakes, running: Callable[[Supervisor], Running]
) -> None:
    config = UpConfig(**FAST, prefill_replicas=2)
    checked: list[str] = []
    stdout, stderr = io.StringIO(), io.StringIO()
    supervisor = Supervisor(
        config,
        command_builder=fakes.builder(config, {}),
        health_check=lambda address, timeout_s: checked.append(address),
        stdout=stdout,
        stderr=stderr,
    )
    handle = running(supervisor)
    handle.wait_ready()

    lines = stdout.getvalue().splitlines()
    assert len(lines) == 1, lines
    ready = json.loads(lines[0])
    assert ready["ready"] is True
    assert [len(ready["prefill"]), len(ready["decode"])] == [2, 1]
    assert all("kv_rendezvous" in prefill for prefill in ready["prefill"])
    assert "kv_rendezvous" not in ready["decode"][0]
    assert {"grpc", "metrics", "pid"} <= ready["gateway"].keys()
    assert "service" not in ready["gateway"]
    # The gateway started beside the replicas and was handed every one of them on its stdin once
    # they were ready; every service was health-checked.
    gateway = fakes.starts("gateway")[0]
    assert "--backends-from-stdin" in gateway["argv"] and "--prefill" not in gateway["argv"]
    assert gateway["argv"][gateway["argv"].index("--http-port") + 1] == "0"
    assert gateway["backends"] == {
        "prefill": [prefill["grpc"] for prefill in ready["prefill"]],
        "decode": [ready["decode"][0]["grpc"]],
    }
    assert gateway["time"] > max(start["time"] for start in fakes.starts() if start["name"] != "gateway")
    services = [ready["gateway"], *ready["prefill"], *ready["decode"]]
    assert sorted(checked) == sorted(service["grpc"] for service in services)
    # Other stdout lines of the children go to stderr, and so does the hint.
    assert "[prefill-1] hello from prefill-1" in stderr.getvalue()
    assert f"generate --address {ready['gateway']['grpc']}" in stderr.getvalue()

    pids = all_pids(ready)
    assert all(is_alive(pid) for pid in pids)
    assert handle.stop() == 0
    assert not any(is_alive(pid) for pid in pids)
    assert len(stdout.getvalue().splitlines()) == 1


@pytest.mark.parametrize("name", ["prefill-0", "decode-0", "gateway"])
def test_a_dead_child_comes_back_on_the_same_ports(
    fakes: Fakes, running: Callable[[Supervisor], Running], caplog: pytest.LogCaptureFixture, name: str
) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.launch.supervisor")
    config = UpConfig(**FAST)
    supervisor = Supervisor(
        config,
        command_builder=fakes.builder(config, {name: "die-once"}),
        health_check=None,
        stdout=io.StringIO(),
    )
    handle = running(supervisor)
    handle.wait_ready()
    role = name.split("-", maxsplit=1)[0]
    first = supervisor.endpoints()[role] if role == "gateway" else supervisor.endpoints()[role][0]
    fakes.go.touch()

    assert wait_until(lambda: len(fakes.starts(name)) == 2), "the child was not restarted"
    first_start, second_start = fakes.starts(name)
    assert first_start["pid"] == first["pid"]
    argv = second_start["argv"]
    assert argv[argv.index("--port") + 1] == first["grpc"].rpartition(":")[2]
    assert argv[argv.index("--metrics-port") + 1] == first["metrics"].rpartition(":")[2]
    if role == "prefill":
        assert argv[argv.index("--kv-port") + 1] == first["kv_rendezvous"].rpartition(":")[2]
    if role == "gateway":  # started again with the backends it was handed at first, as flags
        assert "--backends-from-stdin" not in argv
        assert second_start["backends"] == first_start["backends"]

    def current() -> dict[str, Any]:
        endpoints = supervisor.endpoints()
        return dict(endpoints[role] if role == "gateway" else endpoints[role][0])

    assert wait_until(lambda: current()["pid"] == second_start["pid"]), "the new pid was not taken"
    assert {key: value for key, value in current().items() if key != "pid"} == {
        key: value for key, value in first.items() if key != "pid"
    }
    assert any(
        "restarting it in" in record.getMessage() and name in record.getMessage() for record in caplog.records
    )
    assert len(fakes.starts()) == 4  # nobody else was restarted
    assert handle.stop() == 0
    assert not any(is_alive(pid) for pid in all_pids(supervisor.endpoints()))


def test_gives_up_after_max_restarts_with_exponential_backoff(
    fakes: Fakes, running: Callable[[Supervisor], Running], caplog: pytest.LogCaptureFixture
) -> None:
    config = UpConfig(**{**FAST, "restart_backoff_s": 0.2}, max_restarts=3, restart_window_s=60)
    supervisor = Supervisor(
        config,
        command_builder=fakes.builder(config, {"decode-0": "die-after-ready"}),
        health_check=None,
        stdout=io.StringIO(),
    )
    handle = running(supervisor)
    handle.wait_ready()
    fakes.go.touch()
    assert handle.join() == 1

    starts = fakes.starts("decode-0")
    assert len(starts) == 4  # the first start and max_restarts restarts
    gaps = [later["time"] - earlier["time"] for earlier, later in itertools.pairwise(starts)]
    for gap, delay in zip(gaps, (0.2, 0.4, 0.8), strict=True):
        assert delay <= gap < delay + 2.0, gaps
    assert any(
        "decode-0" in record.getMessage()
        and "giving up" in record.getMessage()
        and record.levelno == logging.ERROR
        for record in caplog.records
    )
    assert not any(is_alive(start["pid"]) for start in fakes.starts())


@pytest.mark.parametrize("name", ["decode-0", "gateway"])
def test_a_child_that_exits_before_ready_fails_startup(
    fakes: Fakes, caplog: pytest.LogCaptureFixture, name: str
) -> None:
    config = UpConfig(**FAST, prefill_replicas=2)
    stdout = io.StringIO()
    supervisor = Supervisor(
        config,
        command_builder=fakes.builder(config, {name: "die-before-ready"}),
        health_check=None,
        stdout=stdout,
        stderr=io.StringIO(),
    )
    assert supervisor.run() == 1
    assert stdout.getvalue() == ""
    assert any(f"{name} exited with code 3 before it was ready" in r.getMessage() for r in caplog.records)
    assert fakes.starts(name) == [] and fakes.starts("gateway") == []
    assert not any(is_alive(start["pid"]) for start in fakes.starts())


def test_startup_timeout(fakes: Fakes, caplog: pytest.LogCaptureFixture) -> None:
    config = UpConfig(**{**FAST, "startup_timeout_s": 1.5})
    supervisor = Supervisor(
        config,
        command_builder=fakes.builder(config, {"gateway": "never-ready"}),
        health_check=None,
        stdout=io.StringIO(),
        stderr=io.StringIO(),
    )
    started = time.monotonic()
    assert supervisor.run() == 1
    assert time.monotonic() - started < 10
    assert any("gateway did not print a ready line" in r.getMessage() for r in caplog.records)
    assert not any(is_alive(start["pid"]) for start in fakes.starts())


def test_a_service_that_is_not_serving_fails_startup(fakes: Fakes, caplog: pytest.LogCaptureFixture) -> None:
    config = UpConfig(**{**FAST, "startup_timeout_s": 1.5})

    def never_serving(address: str, timeout_s: float) -> None:
        time.sleep(min(timeout_s, 0.1))
        raise TimeoutError(address)

    stdout = io.StringIO()
    supervisor = Supervisor(
        config, command_builder=fakes.builder(config, {}), health_check=never_serving, stdout=stdout
    )
    assert supervisor.run() == 1
    assert stdout.getvalue() == ""
    assert any("is not SERVING" in r.getMessage() for r in caplog.records)
    assert not any(is_alive(start["pid"]) for start in fakes.starts())


class DemoGateway(gateway_pb2_grpc.GatewayServicer):
    def __init__(self) -> None:
        self.requests: list[gateway_pb2.GenerateRequest] = []

    def Generate(
        self, request: gateway_pb2.GenerateRequest, context: Any
    ) -> Iterator[gateway_pb2.GenerateResponse]:
        self.requests.append(request)
        yield gateway_pb2.GenerateResponse(token_ids=[1], text="The capital")
        yield gateway_pb2.GenerateResponse(token_ids=[2], text=" is Paris.", finish_reason="eos")


def test_demo_streams_a_greedy_chat_request_to_stderr(
    fakes: Fakes, running: Callable[[Supervisor], Running]
) -> None:
    servicer = DemoGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        config = UpConfig(**FAST, demo=True, demo_prompt="Capital of France?")
        stdout, stderr = io.StringIO(), io.StringIO()
        supervisor = Supervisor(
            config,
            command_builder=fakes.builder(config, {}, report_grpc=address),
            health_check=None,
            stdout=stdout,
            stderr=stderr,
        )
        handle = running(supervisor)
        handle.wait_ready()
        assert wait_until(lambda: "The capital is Paris.\n" in stderr.getvalue()), stderr.getvalue()
        assert "demo> Capital of France?" in stderr.getvalue()
        assert handle.stop() == 0
    finally:
        server.stop(0)
    assert len(stdout.getvalue().splitlines()) == 1
    (request,) = servicer.requests
    assert request.prompt == "Capital of France?" and request.apply_chat_template
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert request.sampling.max_tokens == 64


# -- the supervisor as its own process: signals -------------------------------------------------


def start_runner(
    fakes: Fakes, config: Mapping[str, Any], behaviors: Mapping[str, str]
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(fakes.runner),
            json.dumps(config),
            str(fakes.script),
            str(fakes.log),
            json.dumps(behaviors),
        ],
        stdout=subprocess.PIPE,
        stderr=(fakes.log.parent / "runner.err").open("w"),
        text=True,
    )


def read_ready(proc: subprocess.Popen[str], timeout_s: float = 20.0) -> dict[str, Any]:
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        proc.kill()
        raise AssertionError("no ready line from the supervisor") from None
    ready: dict[str, Any] = json.loads(line)
    assert ready["ready"] is True
    return ready


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_every_child_and_exits_zero(fakes: Fakes, signum: signal.Signals) -> None:
    config = {**FAST, "shutdown_timeout_s": 1.0}
    proc = start_runner(fakes, config, {"decode-0": "ignore-term"})
    try:
        pids = all_pids(read_ready(proc))
        assert all(is_alive(pid) for pid in pids)
        started = time.monotonic()
        proc.send_signal(signum)
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - started < 8
        # decode-0 ignores SIGTERM: it was killed after the grace period; no child is left.
        assert wait_until(lambda: not any(is_alive(pid) for pid in pids), 5)
        assert "did not stop in time; killing it" in (fakes.log.parent / "runner.err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_die_with_a_killed_supervisor(fakes: Fakes) -> None:
    proc = start_runner(fakes, FAST, {})
    try:
        pids = all_pids(read_ready(proc))
        proc.kill()
        proc.wait(timeout=10)
        assert wait_until(lambda: not any(is_alive(pid) for pid in pids), 10), "orphans left behind"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- health client ------------------------------------------------------------------------------


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def closed_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"  # nothing listens there


def test_health_check_statuses(health_server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = health_server
    assert health_client.check(address, 2.0) == "SERVING"
    health_client.wait_serving(address, 2.0)
    assert health_client.check(address, 2.0, service="no.such.Service") == "NOT_FOUND"
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert health_client.check(address, 2.0) == "NOT_SERVING"
    with pytest.raises(TimeoutError, match="last status: NOT_SERVING"):
        health_client.wait_serving(address, 0.3)
    assert health_client.check(closed_address(), 2.0) == "UNAVAILABLE"


def test_wait_serving_waits_for_the_status_to_change(
    health_server: tuple[str, health.HealthServicer],
) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    timer = threading.Timer(0.3, servicer.set, ("", health_pb2.HealthCheckResponse.SERVING))
    timer.start()
    try:
        health_client.wait_serving(address, 5.0)
    finally:
        timer.cancel()


def test_health_command_exit_codes(
    health_server: tuple[str, health.HealthServicer], capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = health_server
    parser = argparse.ArgumentParser()
    health_client.add_health_arguments(parser)
    assert health_client.run_health(parser.parse_args([address])) == 0
    assert capsys.readouterr().out == "SERVING\n"
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert health_client.run_health(parser.parse_args([address, "--timeout-s", "1"])) == 1
    assert capsys.readouterr().out == "NOT_SERVING\n"
    assert health_client.run_health(parser.parse_args([address, "--wait", "--timeout-s", "0.3"])) == 1
    assert capsys.readouterr().out == "NOT_SERVING\n"
    assert health_client.run_health(parser.parse_args([closed_address(), "--timeout-s", "1"])) == 1
    assert capsys.readouterr().out == "UNAVAILABLE\n"
    assert health_client.run_health(parser.parse_args([address, "--timeout-s", "0"])) == 2
