from protos.tandem.v1 import common_pb2 as _common_pb2
from protos.tandem.v1 import kv_transfer_pb2 as _kv_transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "kv_transfer_timeout_ms", "prior_output_token_ids", "prefill_locally")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    kv_transfer_timeout_ms: int
    prior_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_locally: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_transfer_timeout_ms: _Optional[int] = ..., prior_output_token_ids: _Optional[_Iterable[int]] = ..., prefill_locally: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("reserved", "delta")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    reserved: Reserved
    delta: _common_pb2.TokenDelta
    def __init__(self, reserved: _Optional[_Union[Reserved, _Mapping]] = ..., delta: _Optional[_Union[_common_pb2.TokenDelta, _Mapping]] = ...) -> None: ...

class Reserved(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...
