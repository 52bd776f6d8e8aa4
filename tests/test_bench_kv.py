"""``pdserve bench-kv`` end to end: two processes, the real transport and PullKv path, small sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pdserve.kv.channel import GLOO_STREAMS, MIN_CHUNK_BYTES
from pdserve.kv.layout import KvLayout
from tests.stack import REPO_ROOT

pytestmark = pytest.mark.timeout(180)

KEYS = {
    "tokens",
    "bytes",
    "transfer_gbps",
    "memcpy_gbps",
    "control_ms",
    "data_ms",
    "pack_ms",
    "handoff_ms",
    "hop_ms",
    "intact",
    "peer_memcpy_gbps",
    "transfer_to_peer_memcpy",
}


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "bench-kv", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_bench_kv_moves_every_size_intact_and_reports_json(backend: str) -> None:
    done = _bench(
        "--tokens", "3,40,8192", "--repeat", "2", "--layers", "3", "--kv-heads", "2", "--head-dim", "16",
        "--dtype", "float32", "--timeout-s", "30", "--json", "--backend", backend,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["tokens"] for r in results] == [3, 40, 8192]
    layout = KvLayout(keys=((2, 16),) * 3, values=((2, 16),) * 3, dtype=torch.float32)
    if backend == "gloo":
        assert results[-1]["bytes"] >= GLOO_STREAMS * MIN_CHUNK_BYTES  # moved in one chunk per connection
    for result in results:
        assert result.keys() >= KEYS
        assert result["bytes"] == layout.num_bytes(result["tokens"])
        assert result["intact"] is True, "the bytes that arrived differ from the bytes sent"
        for key in (
            "transfer_gbps",
            "memcpy_gbps",
            "peer_memcpy_gbps",
            "transfer_to_peer_memcpy",
            "control_ms",
            "data_ms",
            "hop_ms",
        ):
            assert result[key] > 0, key
        assert result["backend"] == backend


def test_bench_kv_prints_a_table_and_refuses_bad_flags() -> None:
    done = _bench("--tokens", "8", "--repeat", "1", "--layers", "1", "--kv-heads", "1", "--head-dim", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "KV of 1 layers x 1 heads x 8 dims, bfloat16" in lines[0]
    assert lines[1].split()[:2] == ["tokens", "MiB"]
    assert lines[2].split()[0] == "8" and lines[2].split()[-1] == "True"
    assert "backend shm" in lines[0], "on one host auto reads the KV in place"

    refused = _bench("--tokens", "128,0")
    assert refused.returncode == 2
    assert "tokens must be positive integers, got '0'" in refused.stderr


def test_bench_kv_names_each_gpu_once_and_never_pairs_nccl_on_one_gpu() -> None:
    from pdserve.bench.kv.config import BenchKvConfig

    one_gpu = BenchKvConfig(device="cuda", peer_device="cuda:0")
    assert (one_gpu.device, one_gpu.receiver_device) == ("cuda:0", "cuda:0")
    assert one_gpu.backend_name == "cuda-ipc", "auto on one GPU reads the KV in place"
    assert BenchKvConfig(device="cuda:1", peer_device="cuda").backend_name == "nccl"
    assert BenchKvConfig(device="cuda", backend="nccl", peer_device="cuda:1").receiver_device == "cuda:1"
    for device, peer in (("cuda:0", ""), ("cuda", "cuda:0"), ("cuda:2", "cuda:2")):
        with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
            BenchKvConfig(device=device, peer_device=peer, backend="nccl")
    with pytest.raises(ValueError, match="needs CUDA devices on both sides"):
        BenchKvConfig(device="cuda:0", peer_device="cpu", backend="cuda-ipc")
