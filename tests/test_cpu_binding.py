"""Engine processes on CPU cores of their own: the CPU lists, `pdserve up`'s plan, and the binding of
a real process's threads (Linux)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.config import EngineConfig
from pdserve.config.cpu_list import format_cpu_list, parse_cpu_list
from pdserve.launch.cpu_plan import plan_cpus
from pdserve.launch.spec import LaunchSpec, UpConfig, service_command
from tests.stack import REPO_ROOT

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="binds threads on Linux only")


def test_cpu_lists_read_and_write_as_linux_does() -> None:
    assert parse_cpu_list("") == ()
    assert parse_cpu_list("3") == (3,)
    assert parse_cpu_list("0-2,5, 7-8,1") == (0, 1, 2, 5, 7, 8)
    assert format_cpu_list([5, 0, 2, 1, 7, 8]) == "0-2,5,7-8"
    assert format_cpu_list([]) == ""
    for bad in ("a", "1-", "-1", "3-1", "1,,2", "0.5"):
        with pytest.raises(ValueError, match="cpus"):
            parse_cpu_list(bad)


@given(st.sets(st.integers(0, 300)))
def test_a_written_cpu_list_reads_back(cpus: set[int]) -> None:
    assert parse_cpu_list(format_cpu_list(cpus)) == tuple(sorted(cpus))


def test_the_engine_and_up_refuse_what_they_cannot_bind() -> None:
    assert EngineConfig(cpus="0-1").cpus == "0-1"
    with pytest.raises(ValueError, match="CPU list"):
        EngineConfig(cpus="first")
    with pytest.raises(ValueError, match="cpu_bind"):
        UpConfig(cpu_bind="always")


def plan(cpus: int, **kwargs: Any) -> dict[str, str]:
    return plan_cpus(UpConfig(**kwargs), tuple(range(cpus)))


def test_up_gives_each_engine_process_cores_of_its_own_when_there_are_enough() -> None:
    assert plan(2) == {"prefill-0": "0", "decode-0": "1"}
    assert plan(16, threads=2, prefill_replicas=2, decode_ep=2) == {
        "prefill-0": "0-1",
        "prefill-1": "2-3",
        "decode-0": "4-7",
    }
    # A colocated process runs a prefill and a decode engine.
    assert plan(4, mode="colocated", prefill_replicas=2) == {"colocated-0": "0-1", "colocated-1": "2-3"}
    # The CPUs up may use, in their order, whichever they are.
    assert plan_cpus(UpConfig(), (4, 6, 9)) == {"prefill-0": "4", "decode-0": "6"}


def test_up_binds_nothing_with_too_few_cpus_on_gpus_or_when_told_not_to() -> None:
    assert plan(2, prefill_replicas=2) == {}
    assert plan(3, threads=2) == {}
    assert plan(1) == {}
    assert plan(0) == {}
    assert plan(8, device="cuda") == {}
    assert plan(8, cpu_bind="none") == {}


def test_a_bound_engine_is_started_with_its_cpus() -> None:
    config = UpConfig()
    command = service_command(config, LaunchSpec("decode", cpus="1"))
    assert command[command.index("--cpus") + 1] == "1"
    assert "--cpus" not in service_command(config, LaunchSpec("decode"))
    assert "--cpus" not in service_command(config, LaunchSpec("gateway"))


PROBE = """
import json, os, sys, threading
from pdserve.hosting.cpu_binding import bind_process

before = threading.Event()
stop = threading.Event()
early = threading.Thread(target=lambda: (before.set(), stop.wait()), daemon=True)
early.start()
before.wait()
cpus = tuple(int(c) for c in sys.argv[1].split(","))
try:
    bind_process(cpus)
except ValueError as error:
    print(json.dumps({"error": str(error)}))
    sys.exit(0)
late = threading.Thread(target=stop.wait)
late.start()
threads = {t: sorted(os.sched_getaffinity(t)) for t in (int(n) for n in os.listdir("/proc/self/task"))}
stop.set()
print(json.dumps({"threads": list(threads.values()), "count": len(threads)}))
"""


def probe(cpus: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, cpus], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@linux_only
def test_every_thread_of_a_bound_process_runs_on_its_cpus() -> None:
    cpu = min(os.sched_getaffinity(0))
    result = probe(str(cpu))
    # The main thread, a thread from before the binding and one started after it.
    assert result["count"] >= 3
    assert result["threads"] == [[cpu]] * result["count"]


@linux_only
def test_binding_to_cpus_the_process_may_not_use_says_which() -> None:
    outside = max(os.sched_getaffinity(0)) + 1000
    error = probe(f"{min(os.sched_getaffinity(0))},{outside}")["error"]
    assert f"CPUs {outside} are not among this process's allowed CPUs" in error
