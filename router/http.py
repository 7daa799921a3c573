"""The router's OpenAI-compatible HTTP front: a FastAPI app over a `RouterCore`.

The life of a request in here:
1. The body is parsed as JSON (malformed: 400) and validated by its pydantic model (a wrong type: 400 naming the
   field); the model name is checked against `core.models()` (unknown: 404); the sampling fields build
   `SamplingParams`, whose ValueError (a value out of range) becomes a 400 naming the field.
2. Chat messages become prompt token ids through the tokenizer's chat template; a completion's prompt goes to the
   core as text or token ids. Each prompt of a batch is one `core.generate()` stream.
3. The first delta of every stream is awaited before the response starts, so the core's own validation errors
   (empty prompt, prompt longer than the context) are answered as 400s rather than breaking a stream.
4. Not streaming: the deltas are gathered into choices with usage. Streaming: each delta becomes one SSE chunk,
   the usage chunk follows when `stream_options.include_usage` asks for it, then `data: [DONE]`.
5. A client that goes away cancels the task that consumes the core's streams; the streams are closed, which cancels
   the request on the prefill and decode services. A failure ends that request only.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, generate_latest
from pydantic import BaseModel, ValidationError

from router.core import GenerateDelta, GenerateRequest, RequestError, RouterCore
from router.openai_protocol import (DEFAULT_COMPLETION_MAX_TOKENS, AssistantMessage, ChatChoice,
                                    ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogProbs,
                                    ChatStreamChoice, ChatTokenLogprob, CompletionChoice, CompletionChunk,
                                    CompletionLogProbs, CompletionRequest, CompletionResponse, DeltaMessage,
                                    DetokenizeRequest, DetokenizeResponse, ErrorInfo, ErrorResponse, ModelCard,
                                    ModelList, SimpleGenerateRequest, TokenizeRequest, TokenizeResponse, TopLogprob,
                                    UsageInfo, random_id)
from serving.hops import hop

log = logging.getLogger("tandem.router.http")

try:
    _VERSION = importlib.metadata.version("tandem")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never pip-installed (the GPU machine)
    _VERSION = "unknown"

HTTP_REQUESTS = Counter("tandem:http_requests", "HTTP requests answered by the router, by path and status code",
                        ["path", "status"])

# RequestError.code (the core's, shared with gRPC) -> HTTP status.
_STATUS = {"invalid_argument": 400, "not_found": 404, "resource_exhausted": 503, "unavailable": 503, "internal": 500}
# SamplingParams' messages start with the field's name: "temperature=-1.0: must be >= 0 (0 = greedy)".
_FIELD_IN_MESSAGE = re.compile(r"^(\w+)=")


class APIError(Exception):
    """An error answered in OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_request_error(cls, e: RequestError) -> "APIError":
        return cls(_STATUS.get(e.code, 500), e.message, e.field, e.code)

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param,
                                             code=self.code)).model_dump()


def _as_api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestError):
        return APIError.from_request_error(e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal")


def _sse(payload: BaseModel | dict) -> str:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


async def _parse(request: Request, model: type[BaseModel]):
    """The body as `model`; 400 for malformed JSON, a wrong type or an OpenAI feature this server lacks."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        param = str(err["loc"][0]) if err["loc"] else None
        raise APIError(400, f"{where}: {err['msg']} (got {err.get('input')!r})", param, "invalid_type") from None
    if (name := body.unsupported_field()) is not None:
        raise APIError(400, f"{name}={getattr(body, name)!r}: not supported by this server; leave it out",
                       name, "unsupported")
    return body


def _sampling_params(body, *, max_tokens: int | None, logprobs: int | None):
    try:
        return body.sampling_params(max_tokens=max_tokens, logprobs=logprobs)
    except ValueError as e:
        match = _FIELD_IN_MESSAGE.match(str(e))
        raise APIError(400, str(e), match.group(1) if match else None, "invalid_value") from None


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


@dataclass
class _Streams:
    """The core streams of one HTTP request (one per prompt), each with its first delta already received."""
    iterators: list
    firsts: list[GenerateDelta]

    @classmethod
    async def open(cls, core: RouterCore, reqs: list[GenerateRequest]) -> "_Streams":
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


async def _first(it) -> GenerateDelta:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        raise APIError(500, "the core ended a stream without any output", None, "internal") from None


class ClientGone(Exception):
    """The client disconnected before its answer was ready; its request has been cancelled."""


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable):
    """Runs `work`; cancels it if the client disconnects first (then raises ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        log.info("client disconnected: cancelling %s", request.url.path)
        raise ClientGone
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)


@dataclass
class _Choice:
    """What one completion (one of n, of one prompt) has produced so far."""
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, delta: GenerateDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason


class _Usage:
    """Usage across the prompts of one HTTP request: prompt tokens once per prompt, output tokens per choice."""

    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.completion: dict[tuple[int, int], int] = {}

    def add(self, p: int, delta: GenerateDelta) -> None:
        self.prompt[p] = delta.prompt_tokens
        self.completion[(p, delta.index)] = delta.completion_tokens

    def info(self) -> UsageInfo:
        prompt, completion = sum(self.prompt.values()), sum(self.completion.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# ---------------------------------------------------------------------------------------------------- the app
def create_app(core: RouterCore) -> FastAPI:
    app = FastAPI(title="Tandem router", summary="OpenAI-compatible API over disaggregated prefill and decode",
                  docs_url=None, redoc_url=None)
    app.add_middleware(_CountRequests)
    tokenizer = core.tokenizer

    def namer(body):
        """How logprobs name a token: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
        if body.return_tokens_as_token_ids:
            return lambda token_id: f"token_id:{token_id}"
        return lambda token_id: tokenizer.decode([token_id])

    @app.exception_handler(APIError)
    @app.exception_handler(RequestError)
    async def on_api_error(_: Request, e: APIError | RequestError) -> JSONResponse:
        err = _as_api_error(e)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ClientGone)
    async def on_client_gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(_as_api_error(e).body(), status_code=500)

    def check_model(name: str | None) -> str:
        served = core.models()
        if name is None:
            return served[0]
        if name not in served:
            raise APIError(404, f"The model `{name}` does not exist. Served: {', '.join(served)}", "model",
                           "model_not_found")
        return name

    async def open_streams(request: Request, reqs: list[GenerateRequest]) -> _Streams:
        return await _unless_disconnected(request, _Streams.open(core, reqs))

    async def stream_body(events: AsyncIterator[str]) -> AsyncIterator[str]:
        """SSE body: a failure after the first byte is sent as an error event, then [DONE]."""
        try:
            async for event in events:
                yield event
        except Exception as e:
            err = _as_api_error(e)
            if err.status >= 500:
                log.error("stream failed: %s", err.message)
            yield _sse(err.body())
        yield _SSE_DONE

    # ------------------------------------------------------------------------------------------ info routes
    @app.get("/health")
    async def health() -> Response:
        if core.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": "no healthy prefill or decode instance"},
                            status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=core.max_model_len) for name in core.models()])

    @app.get("/version")
    async def version() -> dict:
        return {"version": _VERSION}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> TokenizeResponse:
        body: TokenizeRequest = await _parse(request, TokenizeRequest)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt, messages: give exactly one of them", "prompt", "invalid_value")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages: must not be empty", "messages", "invalid_value")
            ids = chat_prompt_ids(body)
        else:
            ids = tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"]
        return TokenizeResponse(count=len(ids), max_model_len=core.max_model_len, tokens=list(ids))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> DetokenizeResponse:
        body: DetokenizeRequest = await _parse(request, DetokenizeRequest)
        check_model(body.model)
        bad = next((t for t in body.tokens if not 0 <= t < core.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {core.vocab_size})", "tokens",
                           "invalid_value")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    # ------------------------------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        t_in = time.monotonic_ns()
        body: CompletionRequest = await _parse(request, CompletionRequest)
        model = check_model(body.model)
        params = _sampling_params(body, logprobs=body.logprobs, max_tokens=(
            DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens))
        batch = isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], (str, list))
        prompts = body.prompt if batch else [body.prompt]
        rid = random_id("cmpl")
        hop(rid, "http.in", t_in)
        reqs = [GenerateRequest(request_id=f"{rid}-{i}" if len(prompts) > 1 else rid, model=model,
                                prompt=p if isinstance(p, str) else None,
                                prompt_token_ids=None if isinstance(p, str) else list(p), params=params)
                for i, p in enumerate(prompts)]
        echo = [(p if isinstance(p, str) else tokenizer.decode(p)) if body.echo else "" for p in prompts]
        n, created = params.n, int(time.time())
        streams = await open_streams(request, reqs)

        def logprobs_of(choice_prefix_len: int, token_ids: list[int], lps: list[dict[int, float]]):
            if body.logprobs is None:
                return None
            out, offset, token_text = CompletionLogProbs(), choice_prefix_len, namer(body)
            for tid, lp in zip(token_ids, lps):
                text = token_text(tid)
                out.tokens.append(text)
                out.token_logprobs.append(lp.get(tid))
                out.top_logprobs.append({token_text(t): v for t, v in lp.items()})
                out.text_offset.append(offset)
                offset += len(text)
            return out

        if body.stream:
            async def events() -> AsyncIterator[str]:
                usage, offsets = _Usage(), {}  # offsets: choice index -> length of its text sent so far
                async for p, d in streams.deltas():
                    usage.add(p, d)
                    if not (d.text or d.finish_reason or d.token_ids):
                        continue
                    idx = p * n + d.index
                    if not offsets:  # the first chunk with a token
                        hop(rid, "http.sse_first")
                    text = d.text if idx in offsets else echo[p] + d.text
                    lp = logprobs_of(offsets.get(idx, len(echo[p])), d.token_ids, d.logprobs or [])
                    offsets[idx] = offsets.get(idx, 0) + len(text)
                    choice = CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=d.finish_reason)
                    yield _sse(CompletionChunk(id=rid, created=created, model=model, choices=[choice]))
                if body.include_usage:
                    yield _sse(CompletionChunk(id=rid, created=created, model=model, choices=[],
                                               usage=usage.info()))

            return StreamingResponse(stream_body(events()), media_type="text/event-stream")

        usage, choices = _Usage(), {}

        async def gather() -> None:
            async for p, d in streams.deltas():
                usage.add(p, d)
                choices.setdefault((p, d.index), _Choice()).add(d)

        await _unless_disconnected(request, gather())
        out = []
        for (p, i), c in sorted(choices.items()):
            out.append(CompletionChoice(index=p * n + i, text=echo[p] + "".join(c.text),
                                        logprobs=logprobs_of(len(echo[p]), c.token_ids, c.logprobs),
                                        finish_reason=c.finish_reason))
        return JSONResponse(CompletionResponse(id=rid, created=created, model=model, choices=out,
                                               usage=usage.info()).model_dump())

    # ------------------------------------------------------------------------------------------ chat
    def chat_prompt_ids(body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=body.add_generation_prompt)
        else:  # a model without a template (random test models): a plain transcript
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
            text += "assistant:" if body.add_generation_prompt else ""
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat_logprobs(body, token_ids: list[int], lps: list[dict[int, float]]) -> ChatLogProbs:
        content, top_n, token_text = [], body.top_logprobs or 0, namer(body)
        for tid, lp in zip(token_ids, lps):
            text = token_text(tid)
            top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
            content.append(ChatTokenLogprob(
                token=text, logprob=lp.get(tid, float("-inf")), bytes=list(text.encode()),
                top_logprobs=[TopLogprob(token=token_text(t), logprob=v, bytes=list(token_text(t).encode()))
                              for t, v in top]))
        return ChatLogProbs(content=content)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t_in = time.monotonic_ns()
        body: ChatCompletionRequest = await _parse(request, ChatCompletionRequest)
        model = check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", "top_logprobs", "invalid_value")
        prompt_ids = chat_prompt_ids(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # as vLLM: the rest of the context (the core rejects a prompt that fills it)
            max_tokens = max(1, core.max_model_len - len(prompt_ids))
        top_n = body.top_logprobs or 0
        try:
            params = _sampling_params(body, max_tokens=max_tokens, logprobs=top_n if body.logprobs else None)
        except APIError as e:
            if e.param == "max_tokens" and body.max_completion_tokens is not None:
                e.param = "max_completion_tokens"  # the name this client used
            raise
        rid, created = random_id("chatcmpl"), int(time.time())
        hop(rid, "http.in", t_in)
        streams = await open_streams(request, [GenerateRequest(request_id=rid, model=model, prompt=None,
                                                               prompt_token_ids=prompt_ids, params=params)])

        if body.stream:
            async def events() -> AsyncIterator[str]:
                hop(rid, "http.sse_first")  # the role chunks go out once the first token is here
                for i in range(params.n):
                    yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                        ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                         logprobs=None, finish_reason=None)]))
                usage = _Usage()
                async for p, d in streams.deltas():
                    usage.add(p, d)
                    if not (d.text or d.finish_reason or d.token_ids):
                        continue
                    lp = chat_logprobs(body, d.token_ids, d.logprobs or []) if body.logprobs else None
                    yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                        ChatStreamChoice(index=d.index, delta=DeltaMessage(content=d.text), logprobs=lp,
                                         finish_reason=d.finish_reason)]))
                if body.include_usage:
                    yield _sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                                   usage=usage.info()))

            return StreamingResponse(stream_body(events()), media_type="text/event-stream")

        usage, choices = _Usage(), {}

        async def gather() -> None:
            async for p, d in streams.deltas():
                usage.add(p, d)
                choices.setdefault(d.index, _Choice()).add(d)

        await _unless_disconnected(request, gather())
        out = [ChatChoice(index=i, message=AssistantMessage(content="".join(c.text)),
                          logprobs=chat_logprobs(body, c.token_ids, c.logprobs) if body.logprobs else None,
                          finish_reason=c.finish_reason)
               for i, c in sorted(choices.items())]
        return JSONResponse(ChatCompletionResponse(id=rid, created=created, model=model, choices=out,
                                                   usage=usage.info()).model_dump())

    # ------------------------------------------------------------------------------------------ vLLM /generate
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        """vLLM's simple API: each text is the prompt followed by its completion, as vLLM's api_server answers."""
        body: SimpleGenerateRequest = await _parse(request, SimpleGenerateRequest)
        model = check_model(body.model)
        params = _sampling_params(body, logprobs=None, max_tokens=(
            DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens))
        streams = await open_streams(request, [GenerateRequest(request_id=random_id("gen"), model=model,
                                                               prompt=body.prompt, prompt_token_ids=None,
                                                               params=params)])
        texts = [body.prompt] * params.n

        if body.stream:  # vLLM streams the whole texts so far, NUL-terminated JSON objects
            async def chunks() -> AsyncIterator[str]:
                async for _, d in streams.deltas():
                    texts[d.index] += d.text
                    yield json.dumps({"text": texts}) + "\0"

            return StreamingResponse(chunks(), media_type="application/json")

        async def gather() -> None:
            async for _, d in streams.deltas():
                texts[d.index] += d.text

        await _unless_disconnected(request, gather())
        return JSONResponse({"text": texts})

    return app


_COUNTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate", "/v1/models", "/health",
                            "/metrics"})


class _CountRequests:
    """ASGI middleware counting answered requests in tandem:http_requests (streams count when they start)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                path = scope["path"] if scope["path"] in _COUNTED_PATHS else "other"
                HTTP_REQUESTS.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
