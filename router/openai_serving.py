"""The OpenAI endpoints over a RouterCore: per endpoint, the core requests one HTTP request becomes and how their
deltas become its answer, through one streaming path and one gathering path (router/http.py routes to them).

The life of a generating request in here:
1. The endpoint (Completions, ChatCompletions, SimpleGenerate) is built from the parsed body: the model name is
   checked (unknown: 404), chat messages (and tools) go through the chat template (router/chat_template.py), the
   sampling fields build `SamplingParams` (a ValueError becomes a 400 naming the field; tool_choice required or
   named adds its grammar, router/tool_calls.py), and each prompt becomes one GenerateRequest (a completion's batch
   of prompts is several).
2. `Streams.open` starts one `core.generate()` per GenerateRequest and awaits the first delta of each before the
   response starts, so the core's own validation errors (empty prompt, prompt longer than the context) are answered
   as 400s rather than breaking a stream.
3. Streaming (`stream`): the endpoint's head (chat: one role chunk per choice), one event per delta (an SSE chunk;
   /generate: the whole texts so far, NUL-terminated JSON), its tail (the usage chunk when
   `stream_options.include_usage` asks), then `data: [DONE]`. With tools, each chat choice's text goes through its
   tool-call stream first (content and tool_calls deltas; a call opens in a chunk of its own). A failure after the
   first byte is an SSE error event before [DONE] (/generate breaks off, as vLLM's does).
4. Not streaming (`gather`): each choice's text, token ids, logprobs and finish reason, and the usage, from which the
   endpoint builds its response body.
5. The core streams are closed when done, failed or cancelled (a client gone), which cancels the request in the core.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from pydantic import BaseModel

from router.backend import field_in_message
from router.chat_template import ChatTemplateError, render, template_messages
from router.core import GenerateDelta, GenerateRequest, RequestError, RouterCore
from router.openai_protocol import (DEFAULT_COMPLETION_MAX_TOKENS, AssistantMessage, ChatChoice, ChatCompletionChunk,
                                    ChatCompletionRequest, ChatCompletionResponse, ChatLogProbs, ChatStreamChoice,
                                    ChatTokenLogprob, CompletionChoice, CompletionChunk, CompletionLogProbs,
                                    CompletionRequest, CompletionResponse, DeltaMessage, ErrorInfo, ErrorResponse,
                                    FunctionCallOut, PromptTokensDetails, SamplingRequest, SimpleGenerateRequest,
                                    SimpleGenerateResponse, ToolCallOut, TopLogprob, UsageInfo, random_id)
from router.tool_calls import CallStream, ToolChoice, ToolChoiceError, ToolConfig, constrained
from serving.hops import hop

log = logging.getLogger("tandem.router.openai")

# RequestError.code (the core's, shared with gRPC) -> HTTP status. resource_exhausted is a refusal under load (the
# router's admission, router/admission.py): 429 Too Many Requests, with Retry-After.
_STATUS = {"invalid_argument": 400, "not_found": 404, "resource_exhausted": 429, "unavailable": 503, "internal": 500}


class APIError(Exception):
    """An error answered in OpenAI's error JSON; retry_after_s goes in a Retry-After header."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    @classmethod
    def from_request_error(cls, e: RequestError) -> "APIError":
        return cls(_STATUS.get(e.code, 500), e.message, e.field, e.code, e.retry_after_s)

    def headers(self) -> dict[str, str] | None:
        return None if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param,
                                             code=self.code)).model_dump()


def as_api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestError):
        return APIError.from_request_error(e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal")


def sse(payload: BaseModel | dict) -> str:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def check_model(core: RouterCore, name: str | None) -> str:
    """The served model a request names (none: the first served); 404 for any other."""
    served = core.models()
    if name is None:
        return served[0]
    if name not in served:
        raise APIError(404, f"The model `{name}` does not exist. Served: {', '.join(served)}", "model",
                       "model_not_found")
    return name


async def chat_prompt_ids(core: RouterCore, body) -> list[int]:
    """A chat's messages (ChatCompletionRequest, TokenizeRequest) through the chat template (router/chat_template.py)
    as the prompt token ids the model runs (checked and tokenized by the core: off the event loop when long)."""
    try:
        text = render(core.tokenizer, template_messages(body.messages),
                      tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                      add_generation_prompt=body.add_generation_prompt,
                      continue_final_message=body.continue_final_message,
                      chat_template_kwargs=getattr(body, "chat_template_kwargs", None))
    except ChatTemplateError as e:
        raise APIError(400, str(e), e.field, "invalid_value") from None
    return await core.tokenize(text, "messages", add_special_tokens=False)


def _sampling_params(body: SamplingRequest, *, max_tokens: int | None, logprobs: int | None):
    if body.stream_options is not None and not body.stream:  # (every endpoint builds its params here)
        raise APIError(400, "stream_options: only with stream=true", "stream_options", "invalid_value")
    try:
        return body.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
    except ValueError as e:
        raise APIError(400, str(e), field_in_message(str(e)), "invalid_value") from None


def _completion_max_tokens(body: SamplingRequest) -> int:
    return DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens


def _namer(tokenizer, body: SamplingRequest):
    """How logprobs name a token: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
    if body.return_tokens_as_token_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id])


# ---------------------------------------------------------------------------------------------------- streams
async def _close(iterators: list) -> None:
    # Shielded: this runs while the consuming task is being cancelled (a client gone), and closing is what
    # cancels the request on the services.
    with anyio.CancelScope(shield=True):
        for it in iterators:
            try:
                await it.aclose()
            except Exception:  # a stream that failed has already said so; closing must go on
                log.exception("closing a core stream")


async def _first(it) -> GenerateDelta:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        raise APIError(500, "the core ended a stream without any output", None, "internal") from None


@dataclass
class Streams:
    """The core streams of one HTTP request (one per prompt), each with its first delta already received."""
    iterators: list
    firsts: list[GenerateDelta]

    @classmethod
    async def open(cls, core: RouterCore, reqs: list[GenerateRequest]) -> "Streams":
        iterators = [core.generate(req) for req in reqs]
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(_first(it)) for it in iterators]
            return cls(iterators, [t.result() for t in tasks])
        except BaseException as e:
            await _close(iterators)
            if isinstance(e, BaseExceptionGroup):
                raise e.exceptions[0] from None
            raise

    async def deltas(self) -> AsyncIterator[tuple[int, GenerateDelta]]:
        """(prompt index, delta) in arrival order; closes every stream when done, failed or cancelled."""
        try:
            if len(self.iterators) == 1:
                yield 0, self.firsts[0]
                async for delta in self.iterators[0]:
                    yield 0, delta
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, it) -> None:
                try:
                    await queue.put((i, self.firsts[i]))
                    async for delta in it:
                        await queue.put((i, delta))
                    await queue.put((i, None))
                except Exception as e:
                    await queue.put((i, e))

            tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(self.iterators)]
            try:
                running = len(tasks)
                while running:
                    i, item = await queue.get()
                    if item is None:
                        running -= 1
                    elif isinstance(item, Exception):
                        raise item
                    else:
                        yield i, item
            finally:
                for t in tasks:
                    t.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await _close(self.iterators)


@dataclass
class Choice:
    """What one completion (one of n, of one prompt) has produced so far."""
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    timings: dict[str, float] | None = None  # (asked for: on the last delta)

    def add(self, delta: GenerateDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        self.timings = delta.timings or self.timings


class Usage:
    """Usage across the prompts of one HTTP request: prompt tokens once per prompt, output tokens per choice."""

    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.cached: dict[int, int] = {}  # per prompt: its first choice's (the prompt counts once)
        self.completion: dict[tuple[int, int], int] = {}

    def add(self, p: int, delta: GenerateDelta) -> None:
        self.prompt[p] = delta.prompt_tokens
        if delta.index == 0:
            self.cached[p] = delta.cached_tokens
        self.completion[(p, delta.index)] = delta.completion_tokens

    def info(self) -> UsageInfo:
        prompt, completion = sum(self.prompt.values()), sum(self.completion.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached.values())))


# ---------------------------------------------------------------------------------------------------- endpoints
class Endpoint:
    """One generating HTTP request: the core requests it makes, and how its deltas go on the wire."""
    media_type = "text/event-stream"
    end: str | None = SSE_DONE
    """The stream's last event, after an error event too; None: a failure breaks the stream off, unsent."""

    stream: bool
    requests: list[GenerateRequest]

    def head(self) -> list[str]:
        return []

    def event(self, p: int, delta: GenerateDelta) -> str | None:
        """The event for one delta of prompt p (None: nothing to send)."""
        raise NotImplementedError

    def tail(self, usage: Usage) -> list[str]:
        return []

    def response(self, choices: dict[tuple[int, int], Choice], usage: Usage) -> dict:
        """The whole answer, from every (prompt index, choice index)'s output."""
        raise NotImplementedError


class _SSEEndpoint(Endpoint):
    """An OpenAI endpoint: deltas with something in them become chunks; the usage chunk comes last if asked for."""
    body: SamplingRequest

    def chunk(self, choices: list, usage: UsageInfo | None = None) -> BaseModel:
        raise NotImplementedError

    def stream_choice(self, p: int, delta: GenerateDelta) -> BaseModel:
        raise NotImplementedError

    def event(self, p: int, delta: GenerateDelta) -> str | None:
        if not (delta.text or delta.finish_reason or delta.token_ids):
            return None
        return sse(self.chunk([self.stream_choice(p, delta)]))

    def tail(self, usage: Usage) -> list[str]:
        return [sse(self.chunk([], usage.info()))] if self.body.include_usage else []


async def stream(streams: Streams, endpoint: Endpoint) -> AsyncIterator[str]:
    """The response body of every streaming endpoint: head, one event per delta, tail, end (module docstring, 3)."""
    usage = Usage()
    try:
        for event in endpoint.head():
            yield event
        async for p, delta in streams.deltas():
            usage.add(p, delta)
            if (event := endpoint.event(p, delta)) is not None:
                yield event
        for event in endpoint.tail(usage):
            yield event
    except Exception as e:
        if endpoint.end is None:
            raise
        err = as_api_error(e)
        if err.status >= 500:
            log.error("stream failed: %s", err.message)
        yield sse(err.body())
    if endpoint.end is not None:
        yield endpoint.end


async def gather(streams: Streams) -> tuple[dict[tuple[int, int], Choice], Usage]:
    """Every (prompt index, choice index)'s whole output, and the usage, of a request that does not stream."""
    usage, choices = Usage(), {}
    async for p, delta in streams.deltas():
        usage.add(p, delta)
        choices.setdefault((p, delta.index), Choice()).add(delta)
    return choices, usage


class Completions(_SSEEndpoint):
    """`POST /v1/completions`: choices are numbered prompt_index * n + i; `echo` puts the prompt in front."""

    @classmethod
    async def create(cls, core: RouterCore, body: CompletionRequest, t_in: int) -> "Completions":
        """The endpoint; with return_token_ids, text prompts are tokenized here too (as the core does) to be
        reported."""
        endpoint = cls(core, body, t_in)
        if body.return_token_ids:
            endpoint.prompt_ids = [r.prompt_token_ids or await core.tokenize(r.prompt, "prompt")
                                   for r in endpoint.requests]
        return endpoint

    def __init__(self, core: RouterCore, body: CompletionRequest, t_in: int):
        self.body, self.tokenizer = body, core.tokenizer
        self.model = check_model(core, body.model)
        params = _sampling_params(body, logprobs=body.logprobs, max_tokens=_completion_max_tokens(body))
        batch = isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], (str, list))
        prompts = body.prompt if batch else [body.prompt]
        self.rid = random_id("cmpl")
        hop(self.rid, "http.in", t_in)
        self.requests = [GenerateRequest(request_id=f"{self.rid}-{i}" if len(prompts) > 1 else self.rid,
                                         model=self.model, prompt=p if isinstance(p, str) else None,
                                         prompt_token_ids=None if isinstance(p, str) else list(p), params=params,
                                         return_timings=body.return_timings)
                         for i, p in enumerate(prompts)]
        for p in prompts:
            if not isinstance(p, str):
                core.check_token_ids(p)  # (before echo decodes them: the tokenizer overflows on some)
        self.echo = [(p if isinstance(p, str) else self.tokenizer.decode(p)) if body.echo else "" for p in prompts]
        self.stream, self.n, self.created = body.stream, params.n, int(time.time())
        self.offsets: dict[int, int] = {}  # streaming: choice index -> length of its text sent so far
        self.prompt_ids: list[list[int]] | None = None  # return_token_ids: per prompt (set by `create`)

    def logprobs(self, offset: int, token_ids: list[int], lps: list[dict[int, float]]) -> CompletionLogProbs | None:
        """The logprobs of token_ids, whose text starts at `offset` in the choice's text."""
        if self.body.logprobs is None:
            return None
        out, token_text = CompletionLogProbs(), _namer(self.tokenizer, self.body)
        for tid, lp in zip(token_ids, lps):
            text = token_text(tid)
            out.tokens.append(text)
            out.token_logprobs.append(lp.get(tid))
            out.top_logprobs.append({token_text(t): v for t, v in lp.items()})
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def chunk(self, choices: list, usage: UsageInfo | None = None) -> CompletionChunk:
        return CompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)

    def stream_choice(self, p: int, delta: GenerateDelta) -> CompletionChoice:
        idx = p * self.n + delta.index
        if not self.offsets:  # the first chunk with a token
            hop(self.rid, "http.sse_first")
        first = idx not in self.offsets
        text = self.echo[p] + delta.text if first else delta.text
        lp = self.logprobs(self.offsets.get(idx, len(self.echo[p])), delta.token_ids, delta.logprobs or [])
        self.offsets[idx] = self.offsets.get(idx, 0) + len(text)
        ids = self.prompt_ids is not None
        return CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=delta.finish_reason,
                                stop_reason=delta.stop_reason,
                                prompt_token_ids=self.prompt_ids[p] if ids and first else None,
                                token_ids=list(delta.token_ids) if ids else None,
                                timings=delta.timings)

    def response(self, choices: dict[tuple[int, int], Choice], usage: Usage) -> dict:
        ids = self.prompt_ids is not None
        out = [CompletionChoice(index=p * self.n + i, text=self.echo[p] + "".join(c.text),
                                logprobs=self.logprobs(len(self.echo[p]), c.token_ids, c.logprobs),
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                prompt_token_ids=self.prompt_ids[p] if ids else None,
                                token_ids=c.token_ids if ids else None, timings=c.timings)
               for (p, i), c in sorted(choices.items())]
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=out,
                                  usage=usage.info()).model_dump()


class ChatCompletions(_SSEEndpoint):
    """`POST /v1/chat/completions`: one prompt (the rendered messages), n choices; with tools, each choice's text
    goes through a tool-call stream (router/tool_calls.py)."""

    @classmethod
    async def create(cls, core: RouterCore, body: ChatCompletionRequest, t_in: int,
                     tool_config: ToolConfig = ToolConfig()) -> "ChatCompletions":
        check_model(core, body.model)
        return cls(core, body, t_in, await chat_prompt_ids(core, body), tool_config)

    def __init__(self, core: RouterCore, body: ChatCompletionRequest, t_in: int, prompt_ids: list[int],
                 tool_config: ToolConfig = ToolConfig()):
        """prompt_ids: `await chat_prompt_ids(core, body)` (see `create`)."""
        self.body, self.tokenizer = body, core.tokenizer
        self.model = check_model(core, body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs", "invalid_value")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # as vLLM: the rest of the context (the core rejects a prompt that fills it)
            max_tokens = max(1, core.max_model_len - len(prompt_ids))
        try:
            params = _sampling_params(body, max_tokens=max_tokens,
                                      logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        except APIError as e:
            # The names this client used for what SamplingParams calls max_tokens and logprobs.
            used = {"max_tokens": "max_completion_tokens" if body.max_completion_tokens is not None else None,
                    "logprobs": "top_logprobs" if body.top_logprobs is not None else None}.get(e.param)
            if used is not None:
                e.message = used + e.message.removeprefix(e.param)
                e.param = used
            raise
        try:
            self.tools = ToolChoice.of([t.model_dump(exclude_none=True) for t in body.tools or ()],
                                       _dumped(body.tool_choice), body.parallel_tool_calls, tool_config)
            if self.tools.schema is not None:
                params = constrained(params, self.tools.schema, _dumped(body.tool_choice))
        except ToolChoiceError as e:
            raise APIError(400, str(e), e.field, e.code) from None
        self.calls: dict[int, CallStream] = {}  # streaming: choice index -> its tool-call stream
        # vLLM's chat echo: the last message's content goes in front of the reply when its role is the reply's
        # (the reply's role is the last message's without a generation prompt).
        last = body.messages[-1]
        self.echo = last.text() if body.echo and (not body.add_generation_prompt or last.role == "assistant") else ""
        self.prompt_ids = prompt_ids if body.return_token_ids else None
        self.rid, self.created = random_id("chatcmpl"), int(time.time())
        hop(self.rid, "http.in", t_in)
        self.requests = [GenerateRequest(request_id=self.rid, model=self.model, prompt=None,
                                         prompt_token_ids=prompt_ids, params=params,
                                         return_timings=body.return_timings)]
        self.stream, self.n = body.stream, params.n

    def logprobs(self, token_ids: list[int], lps: list[dict[int, float]]) -> ChatLogProbs | None:
        if not self.body.logprobs:
            return None
        content, top_n, token_text = [], self.body.top_logprobs or 0, _namer(self.tokenizer, self.body)
        for tid, lp in zip(token_ids, lps):
            text = token_text(tid)
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
            content.append(ChatTokenLogprob(
                token=text, logprob=lp.get(tid, float("-inf")), bytes=list(text.encode()),
                top_logprobs=[TopLogprob(token=token_text(t), logprob=v, bytes=list(token_text(t).encode()))
                              for t, v in top]))
        return ChatLogProbs(content=content)

    def chunk(self, choices: list, usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)

    def head(self) -> list[str]:
        hop(self.rid, "http.sse_first")  # the role chunks go out once the first token is here
        out = []
        for i in range(self.n):
            chunk = self.chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=self.echo),
                                                 logprobs=None, finish_reason=None)])
            chunk.prompt_token_ids = self.prompt_ids
            out.append(sse(chunk))
        return out

    def event(self, p: int, delta: GenerateDelta) -> str | None:
        if not (delta.text or delta.finish_reason or delta.token_ids):
            return None
        choice = self.stream_choice(p, delta)
        if (choice.delta.content is None and not choice.delta.tool_calls and choice.finish_reason is None
                and choice.logprobs is None and choice.token_ids is None):
            return None  # held back by the tool-call stream: nothing to say yet
        groups = CallStream.chunked(choice.delta.tool_calls or [])
        if len(groups) == 1:
            return sse(self.chunk([choice]))
        # A call's first entry and its arguments go in consecutive chunks (as OpenAI streams them): the content
        # in the first, the token's logprobs, ids and finish reason in the last.
        quiet = dict(logprobs=None, finish_reason=None, stop_reason=None, token_ids=None, timings=None)
        parts = []
        for k, group in enumerate(groups):
            update = {"delta": DeltaMessage(content=choice.delta.content if k == 0 else None, tool_calls=group)}
            parts.append(choice.model_copy(update=update if k == len(groups) - 1 else {**update, **quiet}))
        return "".join(sse(self.chunk([part])) for part in parts)

    def stream_choice(self, p: int, delta: GenerateDelta) -> ChatStreamChoice:
        content, calls, finish = delta.text, None, delta.finish_reason
        if (stream := self.calls.get(delta.index)) is None and (stream := self.tools.stream()) is not None:
            self.calls[delta.index] = stream
        if stream is not None:
            content, calls = stream.feed(delta.text, final=delta.finish_reason is not None)
            content, finish = content or None, stream.finish_reason(delta.finish_reason)
        return ChatStreamChoice(index=delta.index, delta=DeltaMessage(content=content, tool_calls=calls or None),
                                logprobs=self.logprobs(delta.token_ids, delta.logprobs or []),
                                finish_reason=finish, stop_reason=delta.stop_reason,
                                token_ids=list(delta.token_ids) if self.prompt_ids is not None else None,
                                timings=delta.timings)

    def message(self, c: Choice) -> tuple[AssistantMessage, str | None]:
        """A gathered choice's message and finish reason."""
        content, finish, calls = "".join(c.text), c.finish_reason, []
        if (stream := self.tools.stream()) is not None:
            content, _ = stream.feed(content, final=True)
            finish, calls = stream.finish_reason(finish), stream.calls
        content = self.echo + content
        return AssistantMessage(content=content if content or not calls else None, tool_calls=[
            ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
            for call in calls]), finish

    def response(self, choices: dict[tuple[int, int], Choice], usage: Usage) -> dict:
        out = []
        for (_, i), c in sorted(choices.items()):
            message, finish = self.message(c)
            out.append(ChatChoice(index=i, message=message, logprobs=self.logprobs(c.token_ids, c.logprobs),
                                  finish_reason=finish, stop_reason=c.stop_reason,
                                  token_ids=c.token_ids if self.prompt_ids is not None else None,
                                  timings=c.timings))
        return ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, choices=out,
                                      usage=usage.info(), prompt_token_ids=self.prompt_ids).model_dump()


def _dumped(choice):
    """tool_choice as plain data (a named choice's model as a dict)."""
    return choice.model_dump() if isinstance(choice, BaseModel) else choice


class SimpleGenerate(Endpoint):
    """vLLM's `POST /generate`: each text is the prompt followed by its completion, as vLLM's api_server answers;
    streamed as the whole texts so far, NUL-terminated JSON objects."""
    media_type = "application/json"
    end = None

    def __init__(self, core: RouterCore, body: SimpleGenerateRequest):
        model = check_model(core, body.model)
        params = _sampling_params(body, logprobs=None, max_tokens=_completion_max_tokens(body))
        self.requests = [GenerateRequest(request_id=random_id("gen"), model=model, prompt=body.prompt,
                                         prompt_token_ids=None, params=params)]
        self.stream, self.prompt = body.stream, body.prompt
        self.texts = [body.prompt] * params.n

    def event(self, p: int, delta: GenerateDelta) -> str:
        self.texts[delta.index] += delta.text
        return json.dumps({"text": self.texts}) + "\0"

    def response(self, choices: dict[tuple[int, int], Choice], usage: Usage) -> dict:
        return SimpleGenerateResponse(text=[self.prompt + "".join(choices[(0, i)].text) if (0, i) in choices
                                            else self.prompt for i in range(len(self.texts))]).model_dump()
