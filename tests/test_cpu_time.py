"""The benchmark's server CPU accounting: CPU seconds and run-queue waits per process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pdserve.bench.cpu_time import CpuMeter, ProcessUsage, ServerUsage, run_queue_waits
from pdserve.bench.metrics import compute_metrics
from pdserve.bench.report import build_result, format_table

HAS_SCHEDSTAT = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat").exists()

# Spins for the given seconds of wall time on the given CPU (``sched_setaffinity``), then exits.
SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[2])})
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
"""


def fake_task(proc: Path, pid: int, tid: int, schedstat: str) -> None:
    task = proc / str(pid) / "task" / str(tid)
    task.mkdir(parents=True)
    (task / "schedstat").write_text(schedstat)


def test_run_queue_waits_reads_each_threads_second_field(tmp_path: Path) -> None:
    fake_task(tmp_path, 7, 7, "5000000000 1500000000 42\n")
    fake_task(tmp_path, 7, 9, "100 250000000 3\n")
    assert run_queue_waits(7, tmp_path) == {7: 1.5, 9: 0.25}


def test_run_queue_waits_without_schedstat_is_unknown(tmp_path: Path) -> None:
    assert run_queue_waits(8, tmp_path) is None  # no such process
    fake_task(tmp_path, 7, 7, "\n")  # a kernel that reports nothing
    assert run_queue_waits(7, tmp_path) is None


def test_server_usage_totals_and_rows() -> None:
    usage = ServerUsage((ProcessUsage(1, "a", 2.0, 0.5), ProcessUsage(2, "b", 1.0, 0.25)))
    assert (usage.cpu_s, usage.run_queue_wait_s) == (3.0, 0.75)
    assert usage.as_rows()[1] == {"pid": 2, "command": "b", "cpu_s": 1.0, "run_queue_wait_s": 0.25}
    unknown = ServerUsage((ProcessUsage(1, "a", 2.0, None), ProcessUsage(2, "b", 1.0, 0.25)))
    assert unknown.cpu_s == 3.0 and unknown.run_queue_wait_s is None
    assert ServerUsage(()).run_queue_wait_s is None


def test_report_carries_the_waits() -> None:
    usage = ServerUsage((ProcessUsage(1, "pdserve prefill", 2.0, 0.5),))
    metrics = compute_metrics([], 1.0)
    result = build_result(metrics, [], {}, usage)
    assert result["server_cpu_s"] == 2.0 and result["server_run_queue_wait_s"] == 0.5
    assert result["server_processes"] == usage.as_rows()
    assert "Server run-queue wait (s)" in format_table(metrics, usage)
    bare = build_result(metrics, [], {})
    assert (bare["server_cpu_s"], bare["server_run_queue_wait_s"], bare["server_processes"]) == (
        None,
        None,
        [],
    )
    assert "run-queue" not in format_table(metrics)


@pytest.mark.skipif(not HAS_SCHEDSTAT or not hasattr(os, "sched_setaffinity"), reason="Linux schedstat")
def test_two_processes_on_one_core_wait_for_it() -> None:
    """Two spinning children of one parent, both bound to one CPU: each runs about half the time and
    waits the other half."""
    cpu = min(os.sched_getaffinity(0))
    spin = [sys.executable, "-c", SPIN, "2.0", str(cpu)]
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess; ps = [subprocess.Popen({spin!r}) for _ in range(2)]; [p.wait() for p in ps]",
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while len(psutil.Process(parent.pid).children()) < 2:  # both spinning before the first snapshot
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.02)
        meter = CpuMeter([parent.pid])
        meter.start()
        time.sleep(1.0)
        usage = meter.stop()
    finally:
        parent.wait(timeout=30)
    spinners = [p for p in usage.processes if p.cpu_s > 0.1]  # not the parent, which waits for them
    assert len(spinners) == 2, usage
    assert usage.run_queue_wait_s is not None and usage.run_queue_wait_s > 0.3, usage
    for process in spinners:
        assert process.run_queue_wait_s is not None and process.run_queue_wait_s > 0.15, usage
        assert process.command.startswith(sys.executable + " -c")
