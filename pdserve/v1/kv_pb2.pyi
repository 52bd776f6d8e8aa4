from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("version", "id", "prefill_address", "prefill_instance_id", "rendezvous_address", "backend", "model_fingerprint", "num_tokens", "tensors", "num_bytes", "expires_at_unix", "rank", "transports", "host_id", "device", "device_uuid", "block_size", "block_ids")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    id: bytes
    prefill_address: str
    prefill_instance_id: str
    rendezvous_address: str
    backend: str
    model_fingerprint: str
    num_tokens: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    num_bytes: int
    expires_at_unix: float
    rank: int
    transports: _containers.RepeatedScalarFieldContainer[str]
    host_id: str
    device: str
    device_uuid: str
    block_size: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., id: _Optional[bytes] = ..., prefill_address: _Optional[str] = ..., prefill_instance_id: _Optional[str] = ..., rendezvous_address: _Optional[str] = ..., backend: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_tokens: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., num_bytes: _Optional[int] = ..., expires_at_unix: _Optional[float] = ..., rank: _Optional[int] = ..., transports: _Optional[_Iterable[str]] = ..., host_id: _Optional[str] = ..., device: _Optional[str] = ..., device_uuid: _Optional[str] = ..., block_size: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LentKv(_message.Message):
    __slots__ = ("offset", "cuda_ipc")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    offset: int
    cuda_ipc: CudaIpcBuffer
    def __init__(self, offset: _Optional[int] = ..., cuda_ipc: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("memory_handle", "storage_bytes", "storage_offset_bytes", "offset", "num_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "device_index")
    MEMORY_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    memory_handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    offset: int
    num_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_index: int
    def __init__(self, memory_handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., num_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., device_index: _Optional[int] = ...) -> None: ...
