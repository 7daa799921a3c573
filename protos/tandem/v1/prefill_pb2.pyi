from protos.tandem.v1 import common_pb2 as _common_pb2
from protos.tandem.v1 import kv_transfer_pb2 as _kv_transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "decode_address", "kv_transfer_timeout_ms", "prior_output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PRIOR_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    decode_address: str
    kv_transfer_timeout_ms: int
    prior_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., kv_transfer_timeout_ms: _Optional[int] = ..., prior_output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "transfer_done")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer_done: TransferDone
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("delta", "num_prompt_tokens", "num_cached_tokens")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    delta: _common_pb2.TokenDelta
    num_prompt_tokens: int
    num_cached_tokens: int
    def __init__(self, delta: _Optional[_Union[_common_pb2.TokenDelta, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("transfer_bytes", "num_blocks", "transfer_seconds", "tail_seconds", "path")
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TAIL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    transfer_bytes: int
    num_blocks: int
    transfer_seconds: float
    tail_seconds: float
    path: _kv_transfer_pb2.KvTransferPath
    def __init__(self, transfer_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., tail_seconds: _Optional[float] = ..., path: _Optional[_Union[_kv_transfer_pb2.KvTransferPath, str]] = ...) -> None: ...
