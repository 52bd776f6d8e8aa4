"""Which transport a prefill offers and a decode takes, from where each one is."""

from __future__ import annotations

import pytest

from pdserve.kv.transports import AUTO, CUDA_IPC, GLOO, NCCL, SHM, Place, choose, offers

CPU_HOST_A = Place("a", "cpu")
CPU_HOST_B = Place("b", "cpu")
CPU_NO_SHM = Place("", "cpu")
GPU0_HOST_A = Place("a", "cuda:0", "GPU-0", ("GPU-0", "GPU-1"))
GPU1_HOST_A = Place("a", "cuda:1", "GPU-1", ("GPU-0", "GPU-1"))
GPU0_HOST_B = Place("b", "cuda:0", "GPU-9", ("GPU-9",))


def test_offers() -> None:
    assert offers(AUTO, CPU_HOST_A, in_arena=True) == (SHM, GLOO)
    assert offers(AUTO, CPU_HOST_A, in_arena=False) == (GLOO,)
    assert offers(AUTO, GPU0_HOST_A, in_arena=False) == (CUDA_IPC, NCCL, GLOO)
    assert offers(AUTO, Place("", "cuda:0", "GPU-0"), in_arena=False) == (NCCL, GLOO)
    assert offers(GLOO, GPU0_HOST_A, in_arena=False) == (GLOO,)
    assert offers(SHM, CPU_HOST_A, in_arena=False) == ()
    assert offers(NCCL, CPU_HOST_A, in_arena=True) == ()


@pytest.mark.parametrize(
    ("kv_backend", "decode", "offered", "prefill", "expected"),
    [
        (AUTO, CPU_HOST_A, (SHM, GLOO), CPU_HOST_A, SHM),  # one host: read in place
        (AUTO, CPU_HOST_B, (SHM, GLOO), CPU_HOST_A, GLOO),  # two hosts: a pair
        (AUTO, CPU_NO_SHM, (SHM, GLOO), CPU_HOST_A, GLOO),  # no shared memory here
        (GLOO, CPU_HOST_A, (SHM, GLOO), CPU_HOST_A, GLOO),  # forced
        (SHM, CPU_HOST_B, (SHM, GLOO), CPU_HOST_A, None),  # forced, and impossible
        (AUTO, GPU1_HOST_A, (CUDA_IPC, NCCL, GLOO), GPU0_HOST_A, CUDA_IPC),  # two GPUs of one node
        (AUTO, GPU0_HOST_A, (CUDA_IPC, NCCL, GLOO), GPU0_HOST_A, CUDA_IPC),  # one GPU: never NCCL
        (NCCL, GPU0_HOST_A, (CUDA_IPC, NCCL, GLOO), GPU0_HOST_A, None),  # NCCL refuses one GPU
        (AUTO, GPU0_HOST_B, (CUDA_IPC, NCCL, GLOO), GPU0_HOST_A, NCCL),  # two nodes
        (AUTO, CPU_HOST_A, (CUDA_IPC, NCCL, GLOO), GPU0_HOST_A, GLOO),  # a CPU decode of a GPU prefill
        (AUTO, GPU0_HOST_A, (SHM, GLOO), CPU_HOST_A, SHM),  # a GPU decode reads host memory in place
        (AUTO, CPU_HOST_A, (), CPU_HOST_A, None),
    ],
)
def test_choose(
    kv_backend: str, decode: Place, offered: tuple[str, ...], prefill: Place, expected: str | None
) -> None:
    assert choose(kv_backend, decode, offered, prefill) == expected
