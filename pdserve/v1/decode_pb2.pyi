from pdserve.v1 import kv_pb2 as _kv_pb2
from pdserve.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "kv_handle", "first_token_id", "sampling", "timeout_s", "num_generated", "generated_token_ids", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kv_handle: _kv_pb2.KvHandle
    first_token_id: int
    sampling: _sampling_pb2.SamplingParams
    timeout_s: float
    num_generated: int
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., kv_handle: _Optional[_Union[_kv_pb2.KvHandle, _Mapping]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., timeout_s: _Optional[float] = ..., num_generated: _Optional[int] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_sampling_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeManyRequest(_message.Message):
    __slots__ = ("tag", "start", "cancel")
    TAG_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    tag: int
    start: DecodeRequest
    cancel: bool
    def __init__(self, tag: _Optional[int] = ..., start: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class DecodeUpdate(_message.Message):
    __slots__ = ("tag", "token_ids", "finish_reason", "error_code", "error_message", "logprobs")
    TAG_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tag: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    error_code: int
    error_message: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_sampling_pb2.TokenLogprobs]
    def __init__(self, tag: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_sampling_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeManyResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DecodeUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[DecodeUpdate, _Mapping]]] = ...) -> None: ...
