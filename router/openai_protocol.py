"""The OpenAI-compatible HTTP API's request and response bodies (and vLLM's simple `/generate`).

Requests are validated in two layers: pydantic checks types and shapes here, and `SamplingParams` checks ranges
(its `ValueError` names the field). Unknown request fields are ignored, as OpenAI's API does for fields it does
not use. Responses follow OpenAI's field names. `finish_reason: null` and `logprobs: null` are sent as OpenAI
sends them; a stream chunk's `usage` and a delta's unset `role`/`content` are left out when None.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_serializer

from engine.sampling_params import SamplingParams
from router.structured import StructuredFields

# Completions default to 16 tokens (OpenAI's and vLLM's default); chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Stop conditions go to the workers with every sub-request (n x prompts of them) and are checked at every token:
# bounded, so that one request cannot cost the workers more than its tokens do (200,000 stop strings with n=128 once
# kept a decode worker busy until its calls timed out). OpenAI's API takes 4 stop strings; TGI's default is 4.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# OpenAI's limits on tools: 128 per request, names of [a-zA-Z0-9_-]{1,64}.
MAX_TOOLS = 128
ToolName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)  # (the docstrings describe the fields
    # in /openapi.json)

    # OpenAI fields this server does not implement, each with the values that mean "not used". A request that uses
    # one is refused (400 naming it) rather than answered as if it had not asked.
    _unsupported: dict[str, tuple] = {}

    def unsupported_field(self) -> str | None:
        return next((name for name, unused in self._unsupported.items() if getattr(self, name) not in unused), None)


# ---------------------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------------- requests
class StreamOptions(_Body):
    include_usage: bool = False
    """Send one more chunk before `[DONE]` with `choices: []` and the request's usage."""


# Request fields that map one-to-one onto SamplingParams (None = SamplingParams' default).
_SAMPLING_FIELDS = ("n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
                    "top_k", "min_p", "seed", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
                    "min_tokens", "skip_special_tokens")


class SamplingRequest(_Body, StructuredFields):
    """Fields every generating endpoint shares; names as OpenAI's API and vLLM's extensions (top_k, min_p, ...)."""
    model: str | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_tokens_as_token_ids: bool = False
    """vLLM's extension: logprobs name tokens "token_id:<id>" (exact ids, whatever the detokenizer makes of them)."""
    return_token_ids: bool = False
    """vLLM's extension: the prompt's token ids (`prompt_token_ids`) and each choice's (`token_ids`), streamed too."""
    return_timings: bool = False
    """Tandem's extension: each choice's last chunk (or the choice, not streaming) carries `timings`, where its time
    went in seconds: queue_s, prefill_s, kv_transfer_s, first_token_s, mean_itl_s, decode_s."""
    use_beam_search: bool = False
    """vLLM's extension. Beam search is not implemented: true is refused (400 naming the field), not answered by
    sampling as if it had not been asked."""

    def unsupported_field(self) -> str | None:
        return "use_beam_search" if self.use_beam_search else super().unsupported_field()

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        kwargs = {name: getattr(self, name) for name in _SAMPLING_FIELDS if getattr(self, name) is not None}
        return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs,
                              structured_outputs=self.structured_outputs_params())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    # A string, a list of token ids, or a batch of either (choices are numbered prompt_index * n + i).
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    """Top log-probabilities per token (0 = only the sampled token's)."""
    echo: bool = False
    """Put the prompt in front of each choice's text."""
    suffix: str | None = None
    best_of: int | None = None
    _unsupported = {"suffix": (None, ""), "best_of": (None, 1)}


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Body):
    name: ToolName
    arguments: str | dict[str, Any] = "{}"
    """JSON text, as OpenAI sends it back (an object is taken too)."""


class ToolCallIn(_Body):
    """A call an assistant turn made (a tool-calling loop sends it back with the tool's result)."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = None
    """role assistant: the calls it made."""
    tool_call_id: str | None = None
    """role tool: the call this is the result of."""
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDef(_Body):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema."""
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: ToolName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's extension: extra variables for the chat template (e.g. {"enable_thinking": false})."""
    max_completion_tokens: int | None = None
    """OpenAI's newer name for max_tokens; wins when both are given."""
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    """End the prompt with the template's assistant header."""
    continue_final_message: bool = False
    """Continue the last (assistant) message instead of closing it: the reply goes on from its text (needs
    add_generation_prompt=false)."""
    echo: bool = False
    """vLLM's: put the last message's content in front of each reply when its role is the reply's."""
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default: auto with tools (needs --enable-auto-tool-choice), none without."""
    parallel_tool_calls: bool = True
    """false: at most one call per reply."""
    functions: list[Any] | None = None
    _unsupported = {"functions": (None, [])}


class TokenizeRequest(_Body):
    """vLLM's `POST /tokenize`: a completion's `prompt`, or a chat's `messages` through the chat template, as the
    prompt token ids the completion endpoints would run."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt: as /v1/completions tokenizes it
    add_generation_prompt: bool = True  # messages: as /v1/chat/completions renders them
    continue_final_message: bool = False
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Body):
    """vLLM's `POST /detokenize`: token ids back to text."""
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class SimpleGenerateRequest(SamplingRequest):
    """vLLM's `POST /generate`: `prompt`, `stream` and SamplingParams' fields."""
    prompt: str


class SimpleGenerateResponse(BaseModel):
    """vLLM's `/generate` answer: each choice's text is the prompt followed by its completion (streamed: this object
    as the texts so far, NUL-terminated, once per delta)."""
    text: list[str]


# ---------------------------------------------------------------------------------------------------- responses
class _OmitNone(BaseModel):
    """Leaves out the fields named in `_omit_if_none` when they are None."""
    _omit_if_none: tuple[str, ...] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        data = handler(self)
        return {k: v for k, v in data.items() if not (v is None and k in self._omit_if_none)}


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
class RequestTimings(BaseModel):
    """One choice's timing breakdown, in seconds (router/timings.py says what each covers)."""
    queue_s: float
    prefill_s: float
    kv_transfer_s: float
    first_token_s: float
    mean_itl_s: float
    decode_s: float


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_OmitNone):
    _omit_if_none = ("prompt_token_ids", "token_ids", "timings")
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the choice (None: end of sequence, max_tokens, or not ended)."""
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    timings: RequestTimings | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = ""
    """None when the reply is tool calls only (as OpenAI)."""
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(_OmitNone):
    _omit_if_none = ("token_ids", "timings")
    index: int
    message: AssistantMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the choice (None: end of sequence, max_tokens, or not ended)."""
    token_ids: list[int] | None = None
    timings: RequestTimings | None = None


class ChatCompletionResponse(_OmitNone):
    _omit_if_none = ("prompt_token_ids",)
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(_OmitNone):
    _omit_if_none = ("role", "content", "tool_calls")
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """Entries as the SDK assembles them: a call's first has index, id, type, function.name; later ones add to
    function.arguments."""


class ChatStreamChoice(_OmitNone):
    _omit_if_none = ("token_ids", "timings")
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    timings: RequestTimings | None = None


class ChatCompletionChunk(_OmitNone):
    _omit_if_none = ("usage", "prompt_token_ids")
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
    """return_token_ids: on the first chunks (the role's)."""


class CompletionChunk(_OmitNone):
    _omit_if_none = ("usage",)
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class HealthStatus(BaseModel):
    """`GET /health`: "ok" (200), or "unavailable" (503) and why; `GET /livez`: "ok" while the process lives."""
    status: str
    reason: str | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tandem"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
