"""``pdserve up``: runs prefill and decode replicas and the gateway as supervised child processes.

The supervisor starts the prefill and decode replicas (internal ports chosen free) and the gateway
together, reads each replica's one JSON ready line from its stdout, then hands their addresses to
the gateway (on its stdin: it loads its model meanwhile), waits for the gateway's ready line, checks
that every service reports SERVING on ``grpc.health.v1``, and prints its own single JSON ready line
on stdout. Everything else, including the children's logs, goes to stderr.

A child that dies is restarted with exponential backoff on the addresses it first announced; one
that dies more than ``max_restarts`` times within ``restart_window_s`` stops everything with a
non-zero exit. SIGINT or SIGTERM stops the gateway first (it drains the requests in flight), then
the replicas, and kills whatever is left after ``shutdown_timeout_s``. On Linux the children also
get SIGTERM if the supervisor itself dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import logging
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any, TextIO

from pdserve.config import flags
from pdserve.config.backend_line import backend_line
from pdserve.core.logs import configure_logging
from pdserve.core.processes import with_parent_death_signal
from pdserve.launch.child_security import child_client, child_env, gateway_client, run_token
from pdserve.launch.cpu_plan import allowed_cpus, plan_cpus
from pdserve.launch.demo import Demo
from pdserve.launch.device_plan import DevicePlan, plan_devices
from pdserve.launch.spec import (
    COLOCATED,
    DECODE,
    GATEWAY,
    PREFILL,
    CommandBuilder,
    HealthCheck,
    LaunchSpec,
    UpConfig,
    awaits_backends,
    bind_error,
    curl_example,
    describe_exit,
    parse_ready_line,
    pdserve_executable,
    pin_ports,
    service_command,
)
from pdserve.rpc import health_client

logger = logging.getLogger(__name__)


def visible_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


POLL_S = 0.05
HEALTH_ATTEMPT_S = 1.0
THREAD_JOIN_S = 2.0


class _Child:
    """One supervised service and its current process (main-thread state only)."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.proc: subprocess.Popen[str] | None = None
        self.generation = 0
        self.info: dict[str, Any] | None = None
        self.ready = False
        self.started_at = 0.0
        self.restart_at: float | None = None
        self.killed_slow_start = False
        self.deaths: collections.deque[float] = collections.deque()
        self.threads: list[threading.Thread] = []

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True, eq=False)
class _Ready:
    child: _Child
    generation: int
    info: dict[str, Any]


@dataclass(frozen=True, eq=False)
class _Exited:
    child: _Child
    generation: int
    returncode: int


_Event = _Ready | _Exited


class Supervisor:
    """Starts, watches, restarts and stops the children of ``pdserve up``.

    ``command_builder`` maps a ``LaunchSpec`` to the argv of a child (default: the real services);
    ``health_check(address, timeout_s)`` raises TimeoutError unless the address is SERVING
    (None skips the check; the default calls each child with its credentials). ``run`` must be
    called from a thread that outlives the children, which get the run's internal token (and the
    gateway its API key and TLS files) through their environment.
    """

    def __init__(
        self,
        config: UpConfig,
        *,
        command_builder: CommandBuilder | None = None,
        health_check: HealthCheck | None = health_client.wait_serving,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        env: Mapping[str, str] | None = None,
        gpu_count: Callable[[], int] = visible_gpu_count,
    ) -> None:
        """``gpu_count`` says how many GPUs this host shows (asked only when ``config`` uses GPUs)."""
        self.config = config
        self._gpu_count = gpu_count
        self.plan: DevicePlan | None = None
        self.cpus: dict[str, str] = {}  # the CPU list of each bound engine process (cpu_plan)
        self._command: CommandBuilder = command_builder or functools.partial(service_command, config)
        self._health_check = health_check
        self._stdout = sys.stdout if stdout is None else stdout
        self._stderr = sys.stderr if stderr is None else stderr
        self._stderr_lock = threading.Lock()
        self._token = run_token(config)
        self._env = child_env(
            config, self._token, {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        )
        self._events: queue.Queue[_Event] = queue.Queue()
        self._children: list[_Child] = []
        self._stop_requests = 0
        self._demo: Demo | None = None
        # Set once the ready line and the hint are printed.
        self.ready = threading.Event()

    # -- public -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Asks ``run`` to stop everything and return 0; a second request skips the grace period.

        Safe from a signal handler and from any thread (it only bumps a counter).
        """
        self._stop_requests += 1

    def endpoints(self) -> dict[str, Any]:
        """The latest announced addresses and pids, shaped like the ready line (without "ready")."""
        snapshot: dict[str, Any] = {GATEWAY: None, PREFILL: [], DECODE: []}
        for child in list(self._children):
            info = dict(child.info) if child.info is not None else None
            if child.spec.role == GATEWAY:
                snapshot[GATEWAY] = info
            elif child.spec.role == COLOCATED:
                # One process serves both sides: listed as a prefill and as a decode.
                prefill_side = dict(info or {})
                if info is not None:
                    prefill_side["metrics"] = prefill_side.pop("prefill_metrics", info.get("metrics"))
                decode_side = {
                    k: v for k, v in (info or {}).items() if k not in ("prefill_metrics", "kv_rendezvous")
                }
                snapshot[PREFILL].append(prefill_side if info is not None else None)
                snapshot[DECODE].append(decode_side if info is not None else None)
            else:
                snapshot[child.spec.role].append(info)
        return snapshot

    def run(self) -> int:
        """Runs until a stop request (returns 0), a startup failure or too many restarts (1)."""
        previous = self._install_signal_handlers()
        try:
            return self._run()
        except Exception:
            logger.exception("pdserve up failed")
            return 1
        finally:
            try:
                self._shutdown()
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)

    # -- phases -----------------------------------------------------------------------------

    def _run(self) -> int:
        config = self.config
        if not self._gateway_ports_free():
            return 1
        try:
            self.plan = plan = plan_devices(config, self._gpu_count() if config.uses_gpus else 0)
        except ValueError as error:
            logger.error("pdserve up cannot place its processes: %s", error)
            return 2
        deadline = time.monotonic() + config.startup_timeout_s
        roles = [COLOCATED] if config.mode == "colocated" else [PREFILL, DECODE]
        counts = {
            COLOCATED: config.prefill_replicas,
            PREFILL: config.prefill_replicas,
            DECODE: config.decode_replicas,
        }
        self.cpus = cpus = plan_cpus(config, allowed_cpus())
        backends = [
            _Child(LaunchSpec(role, index, devices=plan.of(name), cpus=cpus.get(name, "")))
            for role in roles
            for index in range(counts[role])
            for name in [LaunchSpec(role, index).name]
        ]
        # The gateway starts beside the replicas and loads its model meanwhile; their addresses
        # (ports chosen when they bind) reach it on its stdin once they are ready.
        gateway = _Child(LaunchSpec(GATEWAY, port=config.port, http_port=config.http_port))
        self._children.extend([*backends, gateway])
        for child in self._children:
            self._spawn(child)
        failed = self._await_ready(backends, deadline)
        if failed is not None:
            return failed

        gateway.spec = replace(
            gateway.spec,
            prefill=tuple(self._address(c) for c in backends if c.spec.role in (PREFILL, COLOCATED)),
            decode=tuple(self._address(c) for c in backends if c.spec.role in (DECODE, COLOCATED)),
        )
        self._hand_backends(gateway)
        failed = self._await_ready([gateway], deadline)
        if failed is None:
            failed = self._check_health(deadline)
        if failed is not None:
            return failed

        self._announce()
        if config.demo:
            self._demo = Demo(
                self._address(gateway),
                config.demo_prompt,
                self._stderr,
                self._stderr_lock,
                gateway_client(config),
            )
            self._demo.start()
        return self._monitor()

    def _gateway_ports_free(self) -> bool:
        """False, after saying so, when the gateway's fixed gRPC or HTTP port is taken."""
        config = self.config
        for flag, port, off in (
            ("--port", config.port, ""),
            ("--http-port", config.http_port, ", -1: no HTTP"),
        ):
            error = bind_error(config.host, port) if port > 0 else None
            if error is not None:
                logger.error(
                    "the gateway cannot listen on %s:%d (%s): stop what listens there, or pass %s N "
                    "(0: a free port%s); nothing was started",
                    config.host,
                    port,
                    error,
                    flag,
                    off,
                )
                return False
        return True

    def _await_ready(self, children: Sequence[_Child], deadline: float) -> int | None:
        """None once every child of ``children`` is ready, else the exit code to return."""
        while not all(child.ready for child in children):
            if self._stop_requests:
                logger.info("stop requested during startup")
                return 0
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = ", ".join(child.name for child in children if not child.ready)
                logger.error(
                    "%s did not print a ready line within startup_timeout_s=%g s; stopping",
                    waiting,
                    self.config.startup_timeout_s,
                )
                return 1
            failed = self._startup_event(self._next_event(remaining))
            if failed is not None:
                return failed
        return None

    def _startup_event(self, event: _Event | None) -> int | None:
        if event is None or event.generation != event.child.generation:
            return None
        if isinstance(event, _Ready):
            self._on_ready(event)
            return None
        logger.error(
            "%s %s %s; stopping everything (see its log above)",
            event.child.name,
            describe_exit(event.returncode),
            "during startup" if event.child.ready else "before it was ready",
        )
        event.child.ready = False
        return 1

    def _check_health(self, deadline: float) -> int | None:
        if self._health_check is None:
            return None
        for child in self._children:
            address = self._address(child)
            while True:
                if self._stop_requests:
                    logger.info("stop requested during startup")
                    return 0
                while (event := self._next_event(0)) is not None:
                    failed = self._startup_event(event)
                    if failed is not None:
                        return failed
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.error("%s at %s is not SERVING within the startup timeout", child.name, address)
                    return 1
                check = self._health_check
                if check is health_client.wait_serving:  # the real check: as the child's clients call
                    check = functools.partial(
                        health_client.wait_serving,
                        security=child_client(self.config, self._token, child.spec.role),
                    )
                try:
                    check(address, min(remaining, HEALTH_ATTEMPT_S))
                    break
                except TimeoutError:
                    continue
        return None

    def _announce(self) -> None:
        line: dict[str, Any] = {"ready": True, **self.endpoints()}
        if self.plan is not None:
            line["plan"] = self.plan.describe(self.config.kv_backend)
            if self.cpus:
                line["plan"]["cpus"] = self.cpus
        self._stdout.write(json.dumps(line) + "\n")
        self._stdout.flush()
        gateway = self._children[-1]
        address = self._address(gateway)
        http = gateway.info.get("http") if gateway.info is not None else None
        trusted = (self.config.tls_ca or self.config.public.tls_cert) if self.config.public.tls_cert else ""
        tls_flag = f" --tls-ca {shlex.quote(trusted)}" if trusted else ""
        self._write_stderr(
            f"pdserve is up: gateway on {address} with {self.config.prefill_replicas} prefill and "
            f"{self.config.decode_replicas} decode replica(s). Send a request with:\n"
            f"  {pdserve_executable()} generate --address {address}{tls_flag} "
            '"The capital of France is"\n'
            + (
                curl_example(
                    str(http),
                    self.config.served_model_name or self.config.model,
                    bool(self.config.public.api_key),
                    trusted,
                )
                if http
                else ""
            )
            + "Stop with Ctrl-C.\n"
        )
        self.ready.set()

    def _monitor(self) -> int:
        config = self.config
        while True:
            if self._stop_requests:
                logger.info("stop requested; stopping every service")
                return 0
            now = time.monotonic()
            wait = POLL_S
            for child in self._children:
                if child.restart_at is not None:
                    if child.restart_at > now:
                        wait = min(wait, child.restart_at - now)
                        continue
                    try:
                        self._spawn(child)
                    except OSError as error:
                        logger.error("could not restart %s: %s", child.name, error)
                        failed = self._on_death(child, -1)
                        if failed is not None:
                            return failed
                elif (
                    child.proc is not None
                    and not child.ready
                    and not child.killed_slow_start
                    and now - child.started_at > config.startup_timeout_s
                ):
                    logger.error(
                        "%s was not ready %g s after its restart; killing it",
                        child.name,
                        config.startup_timeout_s,
                    )
                    child.killed_slow_start = True
                    self._kill(child.proc)
            event = self._next_event(wait)
            if event is None or event.generation != event.child.generation:
                continue
            if isinstance(event, _Ready):
                self._on_ready(event)
                continue
            failed = self._on_death(event.child, event.returncode)
            if failed is not None:
                return failed

    # -- events -----------------------------------------------------------------------------

    def _on_ready(self, event: _Ready) -> None:
        child = event.child
        info = dict(event.info)
        if child.proc is not None:
            info.setdefault("pid", child.proc.pid)
        if child.info is None:
            child.spec = pin_ports(child.spec, info)
            logger.info("%s is ready on %s (pid %s)", child.name, info.get("grpc"), info.get("pid"))
        else:
            if info.get("grpc") != child.info.get("grpc"):
                logger.warning(
                    "%s came back on %s instead of %s", child.name, info.get("grpc"), child.info.get("grpc")
                )
            logger.warning(
                "%s restarted: ready on %s (pid %s)", child.name, info.get("grpc"), info.get("pid")
            )
        child.info = info
        child.ready = True

    def _on_death(self, child: _Child, returncode: int) -> int | None:
        """Schedules the restart of a dead child; returns 1 when it died too often."""
        config = self.config
        now = time.monotonic()
        pid = child.info.get("pid") if child.info is not None else None
        child.ready = False
        child.deaths.append(now)
        while child.deaths and child.deaths[0] < now - config.restart_window_s:
            child.deaths.popleft()
        if len(child.deaths) > config.max_restarts:
            logger.error(
                "%s (pid %s) %s: it died %d times within %g s (max_restarts=%d); giving up and stopping "
                "every service",
                child.name,
                pid,
                describe_exit(returncode),
                len(child.deaths),
                config.restart_window_s,
                config.max_restarts,
            )
            return 1
        delay = config.restart_delay_s(len(child.deaths))
        logger.warning(
            "%s (pid %s) %s; restarting it in %g s on the same ports (death %d of at most %d within %g s)",
            child.name,
            pid,
            describe_exit(returncode),
            delay,
            len(child.deaths),
            config.max_restarts,
            config.restart_window_s,
        )
        child.restart_at = now + delay
        return None

    # -- processes --------------------------------------------------------------------------

    def _spawn(self, child: _Child) -> None:
        argv = list(self._command(child.spec))
        child.generation += 1
        child.ready = False
        child.restart_at = None
        child.killed_slow_start = False
        child.started_at = time.monotonic()
        logger.info("starting %s: %s", child.name, " ".join(argv))
        proc = subprocess.Popen(
            with_parent_death_signal(argv, os.getpid()),
            stdin=subprocess.PIPE if awaits_backends(child.spec) else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
            bufsize=1,
            env=self._env,
            process_group=0,
        )
        child.proc = proc
        generation = child.generation
        reader = threading.Thread(
            target=self._read_stdout, args=(child, generation, proc), name=f"{child.name}-stdout", daemon=True
        )
        waiter = threading.Thread(
            target=self._wait_exit,
            args=(child, generation, proc, reader),
            name=f"{child.name}-wait",
            daemon=True,
        )
        child.threads = [reader, waiter]
        reader.start()
        waiter.start()

    @staticmethod
    def _hand_backends(gateway: _Child) -> None:
        """Writes the replicas' addresses to the stdin of a gateway started without them."""
        assert gateway.proc is not None and gateway.proc.stdin is not None
        try:
            gateway.proc.stdin.write(backend_line(gateway.spec.prefill, gateway.spec.decode))
            gateway.proc.stdin.close()
        except OSError as error:  # it exited: its exit is the event that says so
            logger.debug("could not hand the gateway its backends: %s", error)

    def _read_stdout(self, child: _Child, generation: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        announced = False
        for line in proc.stdout:
            if not announced:
                info = parse_ready_line(line)
                if info is not None:
                    announced = True
                    self._events.put(_Ready(child, generation, info))
                    continue
            self._write_stderr(f"[{child.name}] {line.rstrip(chr(10))}\n")

    def _wait_exit(
        self, child: _Child, generation: int, proc: subprocess.Popen[str], reader: threading.Thread
    ) -> None:
        returncode = proc.wait()
        # Lets a ready line printed just before the exit arrive first; a grandchild that holds
        # the pipe open must not hide the exit.
        reader.join(THREAD_JOIN_S)
        self._events.put(_Exited(child, generation, returncode))

    def _next_event(self, timeout_s: float) -> _Event | None:
        try:
            if timeout_s <= 0:
                return self._events.get_nowait()
            return self._events.get(timeout=min(timeout_s, POLL_S))
        except queue.Empty:
            return None

    def _shutdown(self) -> None:
        """SIGTERM the gateway, then the replicas; SIGKILL what is left at the deadline; reap all."""
        if self._demo is not None:
            self._demo.cancel()
        requests_before = self._stop_requests
        deadline = time.monotonic() + self.config.shutdown_timeout_s
        tiers = [
            [child for child in self._children if child.spec.role == GATEWAY],
            [child for child in self._children if child.spec.role != GATEWAY],
        ]
        for tier in tiers:
            alive = [child for child in tier if child.proc is not None and child.proc.poll() is None]
            for child in alive:
                assert child.proc is not None
                logger.info("stopping %s (pid %d)", child.name, child.proc.pid)
                self._signal(child.proc, signal.SIGTERM)
            while (
                any(child.proc is not None and child.proc.poll() is None for child in alive)
                and time.monotonic() < deadline
                and self._stop_requests == requests_before
            ):
                time.sleep(POLL_S)
        for child in self._children:
            if child.proc is not None and child.proc.poll() is None:
                logger.warning("%s (pid %d) did not stop in time; killing it", child.name, child.proc.pid)
                self._kill(child.proc)
        for child in self._children:
            if child.proc is not None:
                child.proc.wait()
            for thread in child.threads:
                thread.join(THREAD_JOIN_S)

    @staticmethod
    def _signal(proc: subprocess.Popen[str], signum: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    @staticmethod
    def _kill(proc: subprocess.Popen[str]) -> None:
        """SIGKILL the child's whole process group (it leads its own), or the child alone."""
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()

    # -- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _address(child: _Child) -> str:
        assert child.info is not None, f"{child.name} has not announced its address"
        return str(child.info["grpc"])

    def _write_stderr(self, text: str) -> None:
        with self._stderr_lock:
            self._stderr.write(text)
            self._stderr.flush()

    def _install_signal_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handle(signum: int, frame: FrameType | None) -> None:
            self.request_stop()

        previous: dict[int, Any] = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, handle)
        return previous


def run_up(config: UpConfig, stdout: TextIO | None = None) -> int:
    """Runs ``pdserve up`` in this thread until stopped; the exit code of the command."""
    return Supervisor(config, stdout=stdout).run()


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``pdserve up``: one per ``UpConfig`` field (and ``PDSERVE_*`` variables).

    Boolean flags also work bare: ``--demo`` means ``--demo true``.
    """
    flags.add_arguments(parser, UpConfig)


def run_up_from_args(args: argparse.Namespace) -> int:
    """``pdserve up``: 0 after a requested stop, 1 on failure, 2 on a bad configuration."""
    config = flags.build_or_report(UpConfig, args, "pdserve up")
    if config is None:
        return 2
    configure_logging()
    return run_up(config)
