from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvTransferPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSFER_PATH_UNSPECIFIED: _ClassVar[KvTransferPath]
    KV_TRANSFER_PATH_GRPC: _ClassVar[KvTransferPath]
    KV_TRANSFER_PATH_CUDA_IPC: _ClassVar[KvTransferPath]
    KV_TRANSFER_PATH_NIXL: _ClassVar[KvTransferPath]
KV_TRANSFER_PATH_UNSPECIFIED: KvTransferPath
KV_TRANSFER_PATH_GRPC: KvTransferPath
KV_TRANSFER_PATH_CUDA_IPC: KvTransferPath
KV_TRANSFER_PATH_NIXL: KvTransferPath

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

class NixlCache(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "mem_type", "base_address", "device_id", "num_blocks")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    mem_type: str
    base_address: int
    device_id: int
    num_blocks: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., mem_type: _Optional[str] = ..., base_address: _Optional[int] = ..., device_id: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class HostIdentity(_message.Message):
    __slots__ = ("boot_id", "hostname", "process_id", "pid", "gpu_uuids")
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    hostname: str
    process_id: str
    pid: int
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, boot_id: _Optional[str] = ..., hostname: _Optional[str] = ..., process_id: _Optional[str] = ..., pid: _Optional[int] = ..., gpu_uuids: _Optional[_Iterable[str]] = ...) -> None: ...

class CudaIpcCache(_message.Message):
    __slots__ = ("host", "device_uuid", "mem_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "tensor_offset_bytes", "num_blocks")
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    host: HostIdentity
    device_uuid: str
    mem_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset_bytes: int
    num_blocks: int
    def __init__(self, host: _Optional[_Union[HostIdentity, _Mapping]] = ..., device_uuid: _Optional[str] = ..., mem_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., tensor_offset_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class KvHandshakeRequest(_message.Message):
    __slots__ = ("host", "layout", "cache", "nixl", "nixl_on_one_host", "nixl_ranks")
    HOST_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    NIXL_ON_ONE_HOST_FIELD_NUMBER: _ClassVar[int]
    NIXL_RANKS_FIELD_NUMBER: _ClassVar[int]
    host: HostIdentity
    layout: KvLayout
    cache: CudaIpcCache
    nixl: NixlCache
    nixl_on_one_host: bool
    nixl_ranks: _containers.RepeatedCompositeFieldContainer[NixlCache]
    def __init__(self, host: _Optional[_Union[HostIdentity, _Mapping]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., cache: _Optional[_Union[CudaIpcCache, _Mapping]] = ..., nixl: _Optional[_Union[NixlCache, _Mapping]] = ..., nixl_on_one_host: _Optional[bool] = ..., nixl_ranks: _Optional[_Iterable[_Union[NixlCache, _Mapping]]] = ...) -> None: ...

class KvHandshakeResponse(_message.Message):
    __slots__ = ("host", "path", "reason")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    host: HostIdentity
    path: KvTransferPath
    reason: str
    def __init__(self, host: _Optional[_Union[HostIdentity, _Mapping]] = ..., path: _Optional[_Union[KvTransferPath, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class KvTransferOpen(_message.Message):
    __slots__ = ("request_id", "layout", "num_prompt_tokens", "num_blocks", "deadline_ms", "path", "cache", "nixl")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KvLayout
    num_prompt_tokens: int
    num_blocks: int
    deadline_ms: int
    path: KvTransferPath
    cache: CudaIpcCache
    nixl: NixlCache
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., path: _Optional[_Union[KvTransferPath, str]] = ..., cache: _Optional[_Union[CudaIpcCache, _Mapping]] = ..., nixl: _Optional[_Union[NixlCache, _Mapping]] = ...) -> None: ...

class KvBlocks(_message.Message):
    __slots__ = ("first_block_index", "num_blocks", "data")
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    first_block_index: int
    num_blocks: int
    data: bytes
    def __init__(self, first_block_index: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KvBlocksReady(_message.Message):
    __slots__ = ("first_block_index", "block_ids")
    FIRST_BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    first_block_index: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_block_index: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KvTransferCommit(_message.Message):
    __slots__ = ("first_token_id", "num_cached_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    num_cached_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class KvTransferMessage(_message.Message):
    __slots__ = ("open", "blocks", "commit", "ready")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    open: KvTransferOpen
    blocks: KvBlocks
    commit: KvTransferCommit
    ready: KvBlocksReady
    def __init__(self, open: _Optional[_Union[KvTransferOpen, _Mapping]] = ..., blocks: _Optional[_Union[KvBlocks, _Mapping]] = ..., commit: _Optional[_Union[KvTransferCommit, _Mapping]] = ..., ready: _Optional[_Union[KvBlocksReady, _Mapping]] = ...) -> None: ...

class KvTransferAck(_message.Message):
    __slots__ = ("request_id", "received_bytes", "num_blocks", "path")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    received_bytes: int
    num_blocks: int
    path: KvTransferPath
    def __init__(self, request_id: _Optional[str] = ..., received_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., path: _Optional[_Union[KvTransferPath, str]] = ...) -> None: ...
