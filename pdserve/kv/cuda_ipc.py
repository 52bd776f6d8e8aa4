"""KV in GPU memory read by another process of the same node (CUDA IPC), through torch's own
reduction of CUDA tensors for multiprocessing.

1. the prefill exports a parked KV (``export``): torch shares the allocation, counts the reader in
   a shared reference counter and records an event the reader waits on;
2. the decode opens it on the GPU that holds it (``open``): a tensor over the prefill's memory;
3. the decode copies it once into its pool and drops the tensor: torch's counter then lets the
   prefill's caching allocator reuse the memory (the prefill drops its own reference when the
   decode gives the KV back, or when the decode dies).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from pdserve.kv.transports import Place
from pdserve.v1 import kv_pb2


def gpu_uuid(index: int) -> str:
    """The identity of visible GPU ``index`` ('' when the driver gives none)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else ""


def visible_gpus() -> tuple[str, ...]:
    """The identity of every GPU this process sees, in index order (empty without CUDA)."""
    if not torch.cuda.is_available():
        return ()
    return tuple(gpu_uuid(i) for i in range(torch.cuda.device_count()))


def place_of(device: torch.device, host_id: str) -> Place:
    """Where a process on ``device`` keeps KV: its shared-memory domain and, on a GPU, its identity."""
    if device.type != "cuda":
        return Place(host_id, "cpu")
    gpus = visible_gpus()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return Place(host_id, f"cuda:{index}", gpus[index] if index < len(gpus) else "", gpus)


def export(buf: torch.Tensor) -> kv_pb2.CudaIpcBuffer:
    """Shares a flat uint8 CUDA tensor with a reader of the same node."""
    if buf.device.type != "cuda" or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"CUDA IPC exports flat uint8 CUDA tensors, got {buf.dtype} on {buf.device}")
    _, args = reduce_tensor(buf)
    (
        _cls,
        _size,
        _stride,
        tensor_offset,
        _storage_cls,
        _dtype,
        device,
        handle,
        storage_bytes,
        storage_offset_bytes,
        _requires_grad,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = args
    return kv_pb2.CudaIpcBuffer(
        memory_handle=handle,
        storage_bytes=storage_bytes,
        storage_offset_bytes=storage_offset_bytes,
        offset=tensor_offset,
        num_bytes=buf.numel(),
        ref_counter_handle=ref_counter_handle,
        ref_counter_offset=ref_counter_offset,
        event_handle=event_handle or b"",
        event_sync_required=bool(event_sync_required),
        device_index=device,
    )


def open_buffer(message: kv_pb2.CudaIpcBuffer, device_index: int) -> torch.Tensor:
    """The exported bytes as a flat uint8 tensor on local GPU ``device_index`` (the GPU that holds
    them, as this process numbers it)."""
    if message.offset + message.num_bytes > message.storage_bytes:
        raise ValueError("the exported KV does not fit in its shared storage")
    with torch.cuda.device(device_index):
        tensor: torch.Tensor = rebuild_cuda_tensor(
            torch.Tensor,
            (message.num_bytes,),
            (1,),
            message.offset,
            torch.storage.TypedStorage,
            torch.uint8,
            device_index,
            message.memory_handle,
            message.storage_bytes,
            message.storage_offset_bytes,
            False,
            message.ref_counter_handle,
            message.ref_counter_offset,
            message.event_handle or None,
            message.event_sync_required,
        )
    return tensor
