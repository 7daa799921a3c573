from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvLayout(_message.Message):
    __slots__ = ("dtype", "layout", "block_size", "num_layers", "num_kv_heads", "head_dim", "block_bytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_bytes: int
    def __init__(self, dtype: _Optional[str] = ..., layout: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class KvTransferOpen(_message.Message):
    __slots__ = ("request_id", "layout", "num_prompt_tokens", "num_blocks", "deadline_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KvLayout
    num_prompt_tokens: int
    num_blocks: int
    deadline_ms: int
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class KvBlocks(_message.Message):
    __slots__ = ("first_block_index", "num_blocks", "data")
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    first_block_index: int
    num_blocks: int
    data: bytes
    def __init__(self, first_block_index: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KvTransferCommit(_message.Message):
    __slots__ = ("first_token_id", "num_cached_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    num_cached_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class KvTransferMessage(_message.Message):
    __slots__ = ("open", "blocks", "commit")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    open: KvTransferOpen
    blocks: KvBlocks
    commit: KvTransferCommit
    def __init__(self, open: _Optional[_Union[KvTransferOpen, _Mapping]] = ..., blocks: _Optional[_Union[KvBlocks, _Mapping]] = ..., commit: _Optional[_Union[KvTransferCommit, _Mapping]] = ...) -> None: ...

class KvTransferAck(_message.Message):
    __slots__ = ("request_id", "received_bytes", "num_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    received_bytes: int
    num_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., received_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...
