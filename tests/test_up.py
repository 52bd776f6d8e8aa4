"""`pdserve up` and `pdserve generate` as a user runs them: real processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.stack import REPO_ROOT, service_env, wait_for

PDSERVE = [sys.executable, "-m", "pdserve"]


@contextlib.contextmanager
def pdserve_up(
    cache_dir: Path, log_path: Path, *args: str
) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """``pdserve up ARGS`` as a user runs it: yields the process and its ready line; kills what is
    left at the end (a test that stops it checks the exit itself). The HTTP front is on a free port
    unless ARGS say otherwise: its default port, 8000, is one for every test."""
    with log_path.open("w") as log:
        up = subprocess.Popen(
            [*PDSERVE, "up", "--http-port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=REPO_ROOT,
            env=service_env(cache_dir),
        )
        try:
            assert up.stdout is not None
            yield up, json.loads(up.stdout.readline())
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def thread_cpus(pid: int) -> set[int]:
    """The CPUs the threads of ``pid`` may run on, all of them together (each thread's own set)."""
    cpus: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            cpus |= os.sched_getaffinity(int(task.name))
    return cpus


def health(address: str) -> str:
    done = subprocess.run(
        [*PDSERVE, "health", address], capture_output=True, text=True, cwd=REPO_ROOT, timeout=30
    )
    return done.stdout.strip()


def generate_json(address: str, env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [*PDSERVE, "generate", "--address", address, "--json", *args],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def test_up_serves_restarts_and_stops(cache_dir: Path, tmp_path: Path) -> None:
    env = service_env(cache_dir)
    with pdserve_up(
        cache_dir, tmp_path / "up.log", "--model", "tiny-llama", "--port", "0", "--restart-backoff-s", "0.2"
    ) as (up, ready):
        assert ready["ready"] is True
        gateway = ready["gateway"]["grpc"]
        assert set(ready["gateway"]) >= {"grpc", "metrics", "pid"}
        assert len(ready["prefill"]) == 1 and len(ready["decode"]) == 1
        assert set(ready["prefill"][0]) >= {"grpc", "metrics", "pid"}
        assert "kv_rendezvous" not in ready["prefill"][0]  # pairs meet over the prefill's gRPC port
        # The plan: both engines on the CPU, KV read in place from shared memory.
        # With a CPU each (--cpu-bind auto), the engines run on cores of their own; the gateway anywhere.
        allowed = sorted(os.sched_getaffinity(0))
        bound = len(allowed) >= 2
        assert ready["plan"] == {
            "devices": {"prefill-0": ["cpu"], "decode-0": ["cpu"]},
            "kv": {"prefill-0->decode-0": "shm"},
            **({"cpus": {"prefill-0": str(allowed[0]), "decode-0": str(allowed[1])}} if bound else {}),
        }
        pids = [ready["gateway"]["pid"], ready["prefill"][0]["pid"], ready["decode"][0]["pid"]]
        assert len(set(pids)) == 3 and all(pid_alive(p) for p in pids)
        if bound:
            assert [sorted(thread_cpus(p)) for p in pids] == [allowed, allowed[:1], allowed[1:2]]

        chunks = generate_json(
            gateway, env, "--prompt-ids", "5,6,7", "--max-tokens", "6", "--temperature", "0"
        )
        first = [t for c in chunks for t in c["token_ids"]]
        assert len(first) == 6 and chunks[-1]["finish_reason"] in ("length", "eos")

        # kill -9 the decode: it comes back on the same address and the stack serves again.
        decode = ready["decode"][0]
        os.kill(decode["pid"], signal.SIGKILL)
        assert wait_for(lambda: not pid_alive(decode["pid"]), 10)
        assert wait_for(lambda: health(decode["grpc"]) == "SERVING", 120, 0.5), (
            tmp_path / "up.log"
        ).read_text()[-3000:]
        again = generate_json(
            gateway, env, "--prompt-ids", "5,6,7", "--max-tokens", "6", "--temperature", "0"
        )
        assert [t for c in again for t in c["token_ids"]] == first
        assert "restart" in (tmp_path / "up.log").read_text().lower()

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        assert wait_for(lambda: not any(pid_alive(p) for p in pids[:2]), 10), "children outlived pdserve up"


def test_up_refuses_to_start_when_a_gateway_port_is_taken(cache_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for flag in ("--http-port", "--port"):
            other = "--port" if flag == "--http-port" else "--http-port"
            done = subprocess.run(
                [*PDSERVE, "up", "--model", "tiny-llama", other, "0", flag, port],
                capture_output=True,
                text=True,
                cwd=REPO_ROOT,
                env=service_env(cache_dir),
                timeout=60,
            )
            assert done.returncode == 1, done.stderr
            assert done.stdout == "" and f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
            assert f"pass {flag} N" in done.stderr and "starting" not in done.stderr


def test_generate_streams_plain_text(stack_pool: Any) -> None:
    stack = stack_pool.get("tiny-llama")
    done = subprocess.run(
        [
            *PDSERVE,
            "generate",
            "--address",
            stack.address,
            "--temperature",
            "0",
            "--max-tokens",
            "12",
            "Hello",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n") and len(done.stdout.strip()) > 0
    bad = subprocess.run(
        [*PDSERVE, "generate", "--address", stack.address, "--prompt-ids", "1,999999"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert bad.returncode == 1
    assert "INVALID_ARGUMENT" in bad.stderr and "prompt_token_ids[1]" in bad.stderr
