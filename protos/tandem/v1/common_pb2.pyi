from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "skip_special_tokens", "include_stop_str_in_output", "structured_outputs")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    structured_outputs: StructuredOutputs
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., structured_outputs: _Optional[_Union[StructuredOutputs, _Mapping]] = ...) -> None: ...

class StructuredOutputs(_message.Message):
    __slots__ = ("json_schema", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ADDITIONAL_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    WHITESPACE_PATTERN_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    choice: StructuredOutputChoices
    grammar: str
    json_object: bool
    structural_tag: str
    disable_any_whitespace: bool
    disable_additional_properties: bool
    whitespace_pattern: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StructuredOutputChoices, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., structural_tag: _Optional[str] = ..., disable_any_whitespace: _Optional[bool] = ..., disable_additional_properties: _Optional[bool] = ..., whitespace_pattern: _Optional[str] = ...) -> None: ...

class StructuredOutputChoices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("candidates",)
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    candidates: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, candidates: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "finish_reason", "stop_reason", "num_output_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    finish_reason: FinishReason
    stop_reason: str
    num_output_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceLoad(_message.Message):
    __slots__ = ("role", "model", "num_requests_running", "num_requests_waiting", "num_queued_tokens", "num_used_blocks", "num_total_blocks", "kv_cache_usage", "block_size", "max_model_len", "num_tracked_requests", "vocab_size", "tokenizer_fingerprint")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TRACKED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    num_requests_running: int
    num_requests_waiting: int
    num_queued_tokens: int
    num_used_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    block_size: int
    max_model_len: int
    num_tracked_requests: int
    vocab_size: int
    tokenizer_fingerprint: str
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_tracked_requests: _Optional[int] = ..., vocab_size: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ...) -> None: ...
