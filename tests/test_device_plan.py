"""Where `pdserve up` puts each process on GPUs, and what it refuses (no GPU needed)."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.launch.device_plan import plan_devices
from pdserve.launch.spec import LaunchSpec, UpConfig, service_command


def plan(num_gpus: int, **kwargs: Any) -> dict[str, tuple[str, ...]]:
    return plan_devices(UpConfig(**kwargs), num_gpus).devices


def test_cpu_processes_stay_on_the_cpu() -> None:
    assert plan(0, prefill_replicas=2, decode_ep=2) == {
        "prefill-0": ("cpu",),
        "prefill-1": ("cpu",),
        "decode-0": ("cpu", "cpu"),
    }


def test_every_process_and_rank_takes_its_own_gpu_in_order() -> None:
    assert plan(8, device="cuda", prefill_replicas=2, decode_ep=2) == {
        "prefill-0": ("cuda:0",),
        "prefill-1": ("cuda:1",),
        "decode-0": ("cuda:2", "cuda:3"),
    }
    assert plan(4, device="cuda:1", prefill_ep=2)["decode-0"] == ("cuda:3",)
    assert plan(2, device="cuda", mode="colocated", prefill_ep=2) == {"colocated-0": ("cuda:0", "cuda:1")}


def test_one_gpu_is_shared_through_cuda_ipc_only() -> None:
    one = plan_devices(UpConfig(device="cuda"), 1)
    assert one.devices == {"prefill-0": ("cuda:0",), "decode-0": ("cuda:0",)}
    assert one.shared and one.describe("auto")["kv"] == {"prefill-0->decode-0": "cuda-ipc"}
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        plan_devices(UpConfig(device="cuda", kv_backend="nccl"), 1)
    with pytest.raises(ValueError, match="needs 4 GPUs"):  # a group's two ranks never share a GPU
        plan_devices(UpConfig(device="cuda", prefill_ep=2, decode_ep=2), 1)
    shared = plan(2, device="cuda", prefill_ep=2, decode_ep=2)
    assert shared == {"prefill-0": ("cuda:0", "cuda:1"), "decode-0": ("cuda:0", "cuda:1")}
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        plan_devices(UpConfig(device="cuda"), 0)


def test_listed_devices() -> None:
    listed = plan(
        4,
        device="cuda",
        prefill_ep=2,
        decode_ep=2,
        prefill_devices=("0", "1"),
        decode_devices=("cuda:3", "2"),
    )
    assert listed == {"prefill-0": ("cuda:0", "cuda:1"), "decode-0": ("cuda:3", "cuda:2")}
    for kwargs, message in [
        ({"prefill_devices": ("0",), "decode_devices": ("1", "2")}, "lists 2 GPUs; 1 are needed"),
        ({"prefill_devices": ("0",), "decode_devices": ("7",)}, "GPU 7 is not visible"),
        ({"prefill_devices": ("x",), "decode_devices": ("1",)}, "as N or cuda:N"),
        (
            {"prefill_ep": 2, "prefill_devices": ("1", "1"), "decode_devices": ("0",)},
            "two expert-parallel ranks",
        ),
        ({"kv_backend": "nccl", "prefill_devices": ("0",), "decode_devices": ("0",)}, "share GPUs"),
    ]:
        with pytest.raises(ValueError, match=message):
            plan_devices(UpConfig(device="cuda", **kwargs), 4)
    with pytest.raises(ValueError, match="set device to cuda"):
        UpConfig(prefill_devices=("0",))


def test_the_plan_names_each_pairs_transport() -> None:
    assert plan_devices(UpConfig(), 0).describe("auto")["kv"] == {"prefill-0->decode-0": "shm"}
    assert plan_devices(UpConfig(kv_backend="gloo"), 0).describe("gloo")["kv"] == {
        "prefill-0->decode-0": "gloo"
    }
    two = plan_devices(UpConfig(device="cuda", kv_backend="nccl"), 2)
    assert two.describe("nccl")["kv"] == {"prefill-0->decode-0": "nccl"}


def test_each_child_is_started_on_its_planned_devices() -> None:
    config = UpConfig(device="cuda", decode_ep=2, kv_backend="cuda-ipc")
    command = service_command(config, LaunchSpec("decode", devices=("cuda:1", "cuda:2")))
    assert command[command.index("--device") + 1] == "cuda:1"
    assert command[command.index("--ep-devices") + 1] == "cuda:1,cuda:2"
    assert command[command.index("--kv-backend") + 1] == "cuda-ipc"
    plain = service_command(UpConfig(), LaunchSpec("prefill"))
    assert plain[plain.index("--device") + 1] == "cpu" and "--ep-devices" not in plain
