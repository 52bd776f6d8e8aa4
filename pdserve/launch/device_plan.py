"""Which device each process of ``pdserve up`` runs on, and how KV moves between them.

On CPU every process runs on the CPU. On GPUs each prefill and decode replica, and each rank of an
expert-parallel group, gets a GPU of its own: listed (``--prefill-devices 0,1 --decode-devices
2,3``), or taken in order from the visible ones from ``--device cuda[:N]`` on. With fewer GPUs
than processes, services may share GPUs only when KV can move between two processes of one GPU
(CUDA IPC: ``--kv-backend auto`` or ``cuda-ipc``; NCCL refuses two ranks on one GPU); a rank never
shares a GPU with another rank of its own group. Anything else is a start-up error that says so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.kv.transports import AUTO, CUDA_IPC, Place, choose, offers
from pdserve.launch.spec import COLOCATED, DECODE, PREFILL, UpConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DevicePlan:
    """The device of every rank of every engine process, by child name (``prefill-0``...)."""

    devices: dict[str, tuple[str, ...]]
    shared: bool = False  # some processes share a GPU

    def of(self, name: str) -> tuple[str, ...]:
        return self.devices.get(name, ())

    def describe(self, kv_backend: str) -> dict[str, object]:
        """What the ready line says: devices per process, and the transport of each KV pair."""
        prefills = [n for n in self.devices if n.startswith(PREFILL)]
        decodes = [n for n in self.devices if n.startswith(DECODE)]
        kv = {
            f"{p}->{d}": _transport(kv_backend, self.devices[p][0], self.devices[d][0])
            for p in prefills
            for d in decodes
        }
        return {"devices": {name: list(devices) for name, devices in self.devices.items()}, "kv": kv}


def plan_devices(config: UpConfig, num_gpus: int) -> DevicePlan:
    """The plan of ``config`` with ``num_gpus`` visible GPUs; ValueError when it cannot run."""
    groups = _groups(config)
    if not config.uses_gpus:
        return DevicePlan({name: ("cpu",) * size for name, size in groups})
    if num_gpus < 1:
        raise ValueError(f"--device {config.device}: no CUDA device is visible")
    if config.prefill_devices or config.decode_devices:
        return _listed(config, groups, num_gpus)
    return _in_order(config, groups, num_gpus)


def _groups(config: UpConfig) -> list[tuple[str, int]]:
    if config.mode == "colocated":
        return [(f"{COLOCATED}-{i}", config.prefill_ep) for i in range(config.prefill_replicas)]
    prefills = [(f"{PREFILL}-{i}", config.prefill_ep) for i in range(config.prefill_replicas)]
    decodes = [(f"{DECODE}-{i}", config.decode_ep) for i in range(config.decode_replicas)]
    return prefills + decodes


def _may_share(config: UpConfig) -> bool:
    return config.kv_backend in (AUTO, CUDA_IPC)


def _listed(config: UpConfig, groups: list[tuple[str, int]], num_gpus: int) -> DevicePlan:
    lists = {PREFILL: list(config.prefill_devices), DECODE: list(config.decode_devices)}
    lists[COLOCATED] = lists[PREFILL]
    devices: dict[str, tuple[str, ...]] = {}
    for role in {name.rpartition("-")[0] for name, _ in groups}:
        members = [(name, size) for name, size in groups if name.startswith(role)]
        needed = sum(size for _, size in members)
        listed = [_gpu(entry, num_gpus) for entry in lists[role]]
        if len(listed) != needed:
            raise ValueError(
                f"--{'prefill' if role != DECODE else 'decode'}-devices lists {len(listed)} GPUs; "
                f"{needed} are needed (one per replica and expert-parallel rank)"
            )
        for name, size in members:
            devices[name], listed = tuple(listed[:size]), listed[size:]
    _check(devices, config)
    return DevicePlan(devices, shared=_shares(devices))


def _in_order(config: UpConfig, groups: list[tuple[str, int]], num_gpus: int) -> DevicePlan:
    start = int(config.device.partition(":")[2] or 0)
    available = num_gpus - start
    needed = sum(size for _, size in groups)
    largest = max(size for _, size in groups)
    if available < needed and not (available >= largest and _may_share(config)):
        raise ValueError(
            f"pdserve up needs {needed} GPUs (one per replica and expert-parallel rank) and sees "
            f"{available} from {config.device} on; sharing GPUs needs --kv-backend auto or cuda-ipc "
            f"and at least {largest} GPUs"
        )
    devices: dict[str, tuple[str, ...]] = {}
    cursor = 0  # wraps around only when processes share GPUs; a group's ranks never do
    for name, size in groups:
        devices[name] = tuple(f"cuda:{start + (cursor + r) % available}" for r in range(size))
        cursor += size
    plan = DevicePlan(devices, shared=available < needed)
    if plan.shared:
        logger.warning(
            "%d processes share %d GPUs; KV moves between them by CUDA IPC", len(groups), available
        )
    return plan


def _gpu(entry: str, num_gpus: int) -> str:
    index_text = entry.removeprefix("cuda:")
    if not index_text.isdigit():
        raise ValueError(f"device lists name GPUs as N or cuda:N, got {entry!r}")
    index = int(index_text)
    if index >= num_gpus:
        raise ValueError(f"GPU {index} is not visible ({num_gpus} visible)")
    return f"cuda:{index}"


def _check(devices: dict[str, tuple[str, ...]], config: UpConfig) -> None:
    for name, ranks in devices.items():
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{name}: two expert-parallel ranks on one GPU ({', '.join(ranks)})")
    if _shares(devices) and not _may_share(config):
        raise ValueError(
            f"processes share GPUs, which --kv-backend {config.kv_backend} cannot move KV between"
        )


def _shares(devices: dict[str, tuple[str, ...]]) -> bool:
    used = [device for ranks in devices.values() for device in ranks]
    return len(set(used)) != len(used)


def _transport(kv_backend: str, prefill: str, decode: str) -> str:
    """The transport a decode on ``decode`` takes from a prefill on ``prefill`` of the same host."""
    gpus = tuple(sorted({prefill, decode} - {"cpu"}))
    prefill_place = Place("host", prefill, prefill if prefill != "cpu" else "", gpus)
    decode_place = Place("host", decode, decode if decode != "cpu" else "", gpus)
    in_arena = prefill == "cpu" and kv_backend in (AUTO, "shm")
    chosen = choose(kv_backend, decode_place, offers(kv_backend, prefill_place, in_arena), prefill_place)
    return chosen or "none"
