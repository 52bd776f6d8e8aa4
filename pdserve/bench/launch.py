"""``pdserve bench --launch MODEL``: runs ``pdserve up`` with its HTTP front for one benchmark.

1. Starts ``python -m pdserve up --model MODEL --port 0 --http-port 0`` (plus ``--mode`` when it
   is not the default), its logs in a temporary file.
2. Reads its one JSON ready line from stdout and takes the gateway's ``http`` address from it.
3. On exit sends SIGTERM and waits for the supervisor to stop its services (SIGKILL after a bound).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODE = "disaggregated"
STOP_TIMEOUT_S = 30.0
LOG_TAIL_CHARS = 3000


def up_command(model: str, mode: str) -> list[str]:
    command = [sys.executable, "-m", "pdserve", "up", "--model", model, "--port", "0", "--http-port", "0"]
    if mode != DEFAULT_MODE:
        command += ["--mode", mode]
    return command


def http_base_url(ready: dict[str, Any]) -> str:
    """``http://HOST:PORT`` of the HTTP front named by a ready line; ValueError when it has none."""
    gateway = ready.get("gateway")
    address = gateway.get("http") if isinstance(gateway, dict) else None
    address = address or ready.get("http")
    if not isinstance(address, str) or not address:
        raise ValueError(f"the ready line names no HTTP address (is the HTTP front on?): {ready}")
    return address if address.startswith(("http://", "https://")) else f"http://{address}"


class LaunchedServer:
    """``pdserve up`` as a context manager: ``base_url`` and ``pid`` are set once it is ready."""

    def __init__(self, model: str, mode: str, timeout_s: float) -> None:
        self.command = up_command(model, mode)
        self.timeout_s = timeout_s
        self.base_url = ""
        self.ready: dict[str, Any] = {}
        self._proc: subprocess.Popen[str] | None = None
        self._log_path = Path(tempfile.mkstemp(prefix="pdserve-bench-up-", suffix=".log")[1])
        self._ready_line: list[dict[str, Any]] = []
        self._ready_event = threading.Event()

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("the server is not started")
        return self._proc.pid

    def __enter__(self) -> LaunchedServer:
        logger.info("starting %s (log %s)", " ".join(self.command), self._log_path)
        with self._log_path.open("w") as log:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=server_env(),
            )
        threading.Thread(target=self._read_stdout, args=(self._proc,), daemon=True).start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _read_stdout(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if self._ready_event.is_set():
                continue
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict) and message.get("ready") is True:
                self._ready_line.append(message)
                self._ready_event.set()

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.timeout_s
        while not self._ready_event.wait(0.1):
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"pdserve up exited with code {self._proc.returncode} before it was ready; "
                    f"log tail:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"pdserve up not ready within {self.timeout_s:g} s; log tail:\n{self.log_tail()}"
                )
        self.ready = self._ready_line[0]
        self.base_url = http_base_url(self.ready)

    def log_tail(self) -> str:
        return self._log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``; removes the log when all went well."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "pdserve up (pid %d) did not stop in %g s; killing it", proc.pid, STOP_TIMEOUT_S
                )
                proc.kill()
                proc.wait()
        if proc.returncode == 0:
            self._log_path.unlink(missing_ok=True)
        else:
            logger.warning("pdserve up exited with code %s; its log is %s", proc.returncode, self._log_path)
        self._proc = None


def server_env() -> dict[str, str]:
    """The environment of the launched server: this one, with one intra-op thread by default."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
