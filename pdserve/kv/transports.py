"""How a KV moves from a prefill to a decode, and how the two ends agree on it.

- ``shm``: the KV is parked in the prefill's shared-memory arena; a decode of the same host reads
  it in place (``pdserve.kv.shared_memory``);
- ``cuda-ipc``: the KV is parked in the prefill's GPU memory; a decode of the same node on a GPU
  reads it in place through CUDA IPC (``pdserve.kv.cuda_ipc``);
- ``nccl``: sent GPU to GPU over a 2-rank NCCL pair (two different GPUs: NCCL refuses one);
- ``gloo``: sent over a 2-rank gloo pair in host memory; works between any two processes.

Each parked KV's handle lists what its prefill offers, in the prefill's order of preference
(``offers``), with where the prefill is (``Place``: shared-memory domain, device, GPU identity).
The decode takes the first transport it can use from where it is (``choose``); a CUDA prefill and a
CPU decode meet on gloo. ``--kv-backend`` narrows either end to one transport; ``auto`` takes them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.config import BACKENDS

GLOO = "gloo"
NCCL = "nccl"
SHM = "shm"
CUDA_IPC = "cuda-ipc"
AUTO = "auto"
KV_BACKENDS = BACKENDS  # the values of --kv-backend: AUTO and every transport
NETWORK = (GLOO, NCCL)
SAME_HOST = (SHM, CUDA_IPC)


@dataclass(frozen=True)
class Place:
    """Where one process keeps KV: its shared-memory domain ('' when none), its device, that GPU's
    identity ('' on CPU) and the identities of every GPU it can see, in index order."""

    host_id: str
    device: str
    device_uuid: str = ""
    visible_gpus: tuple[str, ...] = ()

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")


def network_backend(device: str) -> str:
    """The torch.distributed backend of a prefill's pairs: NCCL from a GPU, gloo from host memory."""
    return NCCL if device.startswith("cuda") else GLOO


def offers(kv_backend: str, place: Place, in_arena: bool) -> tuple[str, ...]:
    """What a prefill at ``place`` offers for one KV (``in_arena``: parked in its shm arena)."""
    if place.on_cuda:
        ordered = [CUDA_IPC] if place.host_id else []
        ordered += [NCCL, GLOO]
    else:
        ordered = [SHM] if in_arena else []
        ordered += [GLOO]
    if kv_backend == AUTO:
        return tuple(ordered)
    return (kv_backend,) if kv_backend in ordered else ()


def choose(kv_backend: str, local: Place, offered: Sequence[str], remote: Place) -> str | None:
    """The first transport of ``offered`` a decode at ``local`` can use to reach a prefill at
    ``remote`` (``kv_backend`` narrows it), or None."""
    same_host = bool(local.host_id) and local.host_id == remote.host_id
    for transport in offered:
        if kv_backend not in (AUTO, transport):
            continue
        if transport == SHM and same_host:
            return transport
        if transport == CUDA_IPC and same_host and local.on_cuda and remote.device_uuid in local.visible_gpus:
            return transport
        if (
            transport == NCCL
            and local.on_cuda
            and remote.on_cuda
            and (not local.device_uuid or local.device_uuid != remote.device_uuid)
        ):
            return transport
        if transport == GLOO:
            return transport
    return None
