from protos.tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "params", "return_timings", "return_prompt_token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    return_timings: bool
    return_prompt_token_ids: bool
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_timings: _Optional[bool] = ..., return_prompt_token_ids: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters_json", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "function")
    MODE_FIELD_NUMBER: _ClassVar[int]
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    mode: str
    function: str
    def __init__(self, mode: _Optional[str] = ..., function: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("model", "messages", "params", "add_generation_prompt", "continue_final_message", "chat_template_kwargs_json", "tools", "tool_choice", "parallel_tool_calls", "return_timings", "return_prompt_token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    params: _common_pb2.SamplingParams
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs_json: str
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool
    return_timings: bool
    return_prompt_token_ids: bool
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs_json: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., return_timings: _Optional[bool] = ..., return_prompt_token_ids: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "delta", "usage", "timings", "prompt_token_ids", "content", "tool_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    delta: _common_pb2.TokenDelta
    usage: Usage
    timings: RequestTimings
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., delta: _Optional[_Union[_common_pb2.TokenDelta, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[RequestTimings, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "text")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    model: str
    text: str
    def __init__(self, model: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models", "max_model_len")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    max_model_len: int
    def __init__(self, models: _Optional[_Iterable[str]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class RequestTimings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "kv_transfer_s", "first_token_s", "mean_itl_s", "decode_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_ITL_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    first_token_s: float
    mean_itl_s: float
    decode_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., kv_transfer_s: _Optional[float] = ..., first_token_s: _Optional[float] = ..., mean_itl_s: _Optional[float] = ..., decode_s: _Optional[float] = ...) -> None: ...
