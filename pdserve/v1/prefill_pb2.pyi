from pdserve.v1 import kv_pb2 as _kv_pb2
from pdserve.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "num_generated")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _sampling_pb2.SamplingParams
    num_generated: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., num_generated: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "finish_reason", "kv_handle", "queue_seconds", "cached_tokens", "prefix_cache_tokens", "first_token_logprobs", "prompt_logprobs", "choices")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    finish_reason: str
    kv_handle: _kv_pb2.KvHandle
    queue_seconds: float
    cached_tokens: int
    prefix_cache_tokens: int
    first_token_logprobs: _sampling_pb2.TokenLogprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.TokenLogprobs]
    choices: _containers.RepeatedCompositeFieldContainer[PrefillChoice]
    def __init__(self, first_token_id: _Optional[int] = ..., finish_reason: _Optional[str] = ..., kv_handle: _Optional[_Union[_kv_pb2.KvHandle, _Mapping]] = ..., queue_seconds: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., prefix_cache_tokens: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[_sampling_pb2.TokenLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_sampling_pb2.TokenLogprobs, _Mapping]]] = ..., choices: _Optional[_Iterable[_Union[PrefillChoice, _Mapping]]] = ...) -> None: ...

class PrefillChoice(_message.Message):
    __slots__ = ("first_token_id", "finish_reason", "kv_handle", "first_token_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    finish_reason: str
    kv_handle: _kv_pb2.KvHandle
    first_token_logprobs: _sampling_pb2.TokenLogprobs
    def __init__(self, first_token_id: _Optional[int] = ..., finish_reason: _Optional[str] = ..., kv_handle: _Optional[_Union[_kv_pb2.KvHandle, _Mapping]] = ..., first_token_logprobs: _Optional[_Union[_sampling_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class PullKvRequest(_message.Message):
    __slots__ = ("handle_id", "decode_instance_id", "pair_generation", "transport", "pair_secret")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PAIR_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PAIR_SECRET_FIELD_NUMBER: _ClassVar[int]
    handle_id: bytes
    decode_instance_id: str
    pair_generation: int
    transport: str
    pair_secret: bytes
    def __init__(self, handle_id: _Optional[bytes] = ..., decode_instance_id: _Optional[str] = ..., pair_generation: _Optional[int] = ..., transport: _Optional[str] = ..., pair_secret: _Optional[bytes] = ...) -> None: ...

class PullKvResponse(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class PullKvManyRequest(_message.Message):
    __slots__ = ("handle_ids", "decode_instance_id", "pair_generation", "transport", "pair_secret")
    HANDLE_IDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PAIR_GENERATION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PAIR_SECRET_FIELD_NUMBER: _ClassVar[int]
    handle_ids: _containers.RepeatedScalarFieldContainer[bytes]
    decode_instance_id: str
    pair_generation: int
    transport: str
    pair_secret: bytes
    def __init__(self, handle_ids: _Optional[_Iterable[bytes]] = ..., decode_instance_id: _Optional[str] = ..., pair_generation: _Optional[int] = ..., transport: _Optional[str] = ..., pair_secret: _Optional[bytes] = ...) -> None: ...

class PullKvManyResponse(_message.Message):
    __slots__ = ("num_bytes", "lent")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LENT_FIELD_NUMBER: _ClassVar[int]
    num_bytes: _containers.RepeatedScalarFieldContainer[int]
    lent: _containers.RepeatedCompositeFieldContainer[_kv_pb2.LentKv]
    def __init__(self, num_bytes: _Optional[_Iterable[int]] = ..., lent: _Optional[_Iterable[_Union[_kv_pb2.LentKv, _Mapping]]] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("handle_id", "decode_instance_id", "pair_secret")
    HANDLE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PAIR_SECRET_FIELD_NUMBER: _ClassVar[int]
    handle_id: bytes
    decode_instance_id: str
    pair_secret: bytes
    def __init__(self, handle_id: _Optional[bytes] = ..., decode_instance_id: _Optional[str] = ..., pair_secret: _Optional[bytes] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PairStoreRequest(_message.Message):
    __slots__ = ("decode_instance_id", "pair_secret", "pair_generation", "op", "keys", "value", "expected", "amount", "timeout_s")
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PAIR_SECRET_FIELD_NUMBER: _ClassVar[int]
    PAIR_GENERATION_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    decode_instance_id: str
    pair_secret: bytes
    pair_generation: int
    op: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    expected: bytes
    amount: int
    timeout_s: float
    def __init__(self, decode_instance_id: _Optional[str] = ..., pair_secret: _Optional[bytes] = ..., pair_generation: _Optional[int] = ..., op: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class PairStoreResponse(_message.Message):
    __slots__ = ("value", "number", "ready")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    number: int
    ready: bool
    def __init__(self, value: _Optional[bytes] = ..., number: _Optional[int] = ..., ready: _Optional[bool] = ...) -> None: ...
