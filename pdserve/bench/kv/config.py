"""Settings of ``pdserve bench-kv`` (flags and ``PDSERVE_*`` variables come from these fields).

The default cache shape is DeepSeekMoE-16B's: 28 layers, 16 KV heads of 128 dims for keys and
for values, bfloat16: 224 KiB per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.config import BACKENDS
from pdserve.config.checks import check_at_least, check_choice, check_device, check_positive, device_at

if TYPE_CHECKING:
    import torch

    from pdserve.kv.layout import KvLayout

DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class BenchKvConfig:
    tokens: tuple[str, ...] = field(
        default=("128", "512", "2048", "8192"),
        metadata={"help": "KV sizes to move, in tokens (comma-separated)"},
    )
    layers: int = field(default=28, metadata={"help": "layers of the cache"})
    kv_heads: int = field(default=16, metadata={"help": "KV heads per layer"})
    head_dim: int = field(default=128, metadata={"help": "dims per head (keys and values)"})
    dtype: str = field(default="bfloat16", metadata={"help": "dtype of the cache"})
    device: str = field(
        default="cpu", metadata={"help": "device of the cache on both sides, e.g. cpu or cuda:0"}
    )
    peer_device: str = field(default="", metadata={"help": "device of the receiving side ('' = --device)"})
    backend: str = field(
        default="auto",
        metadata={"help": "shm, cuda-ipc, nccl, gloo, or auto (what pdserve takes on one host)"},
    )
    repeat: int = field(default=5, metadata={"help": "timed runs per size (after one warm-up run)"})
    threads: int = field(default=1, metadata={"help": "intra-op torch threads of each process"})
    timeout_s: float = field(default=120.0, metadata={"help": "bound on every transfer and wait"})
    host: str = field(default="127.0.0.1", metadata={"help": "address both processes use"})
    shm_dir: str = field(default="/dev/shm", metadata={"help": "shared-memory directory (shm transport)"})
    json: bool = field(default=False, metadata={"help": "print one JSON object per size instead of a table"})

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError("tokens must name at least one size")
        for text in self.tokens:
            if not text.isdigit() or int(text) < 1:
                raise ValueError(f"tokens must be positive integers, got {text!r}")
        for name in ("layers", "kv_heads", "head_dim", "repeat", "threads"):
            check_at_least(name, getattr(self, name), 1)
        check_choice("dtype", self.dtype, DTYPES)
        check_device("device", self.device)
        if self.peer_device:
            check_device("peer_device", self.peer_device)
        # One name per GPU (``cuda`` is ``cuda:0``), so both sides and every comparison agree.
        object.__setattr__(self, "device", device_at(self.device))
        object.__setattr__(self, "peer_device", device_at(self.peer_device))
        check_choice("backend", self.backend, BACKENDS)
        if self.backend_name in ("nccl", "cuda-ipc") and not (
            self.device.startswith("cuda") and self.receiver_device.startswith("cuda")
        ):
            raise ValueError(f"the {self.backend_name} backend needs CUDA devices on both sides")
        if self.backend_name == "nccl" and self.receiver_device == self.device:
            raise ValueError(
                f"NCCL refuses two ranks on one GPU: give --peer-device another GPU than {self.device}, "
                "or measure cuda-ipc"
            )
        if self.backend_name == "shm" and self.device != "cpu":
            raise ValueError("the shm backend moves host memory: --device must be cpu")
        check_positive("timeout_s", self.timeout_s)

    @property
    def token_counts(self) -> list[int]:
        return [int(t) for t in self.tokens]

    @property
    def receiver_device(self) -> str:
        return self.peer_device or self.device

    @property
    def backend_name(self) -> str:
        """The transport measured: the one asked for, else what ``--kv-backend auto`` takes between
        two processes of one host (shared memory from host memory, CUDA IPC on one GPU, NCCL
        between two)."""
        if self.backend != "auto":
            return self.backend
        if not self.device.startswith("cuda"):
            return "shm"
        return "cuda-ipc" if self.receiver_device == self.device else "nccl"

    def layout(self) -> KvLayout:
        from pdserve.kv.layout import KvLayout

        heads = ((self.kv_heads, self.head_dim),) * self.layers
        return KvLayout(keys=heads, values=heads, dtype=self.torch_dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype
