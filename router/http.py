"""The router's OpenAI-compatible HTTP front: a FastAPI app over a `RouterCore`, its routes, error handlers and
request counting; router/openai_serving.py serves the generating endpoints.

The life of a request in here:
1. The body is parsed as JSON (malformed: 400) and validated by its pydantic model (a wrong type: 400 naming the
   field, an OpenAI feature this server lacks: 400 naming it).
2. A generating route builds its endpoint from the body (router/openai_serving.py: the model name, the sampling
   fields, the prompts) and opens its core streams, awaiting the first delta of each before the response starts.
3. Streaming: the endpoint's event stream is the response body. Not streaming: the gathered choices and usage
   become one JSON body.
4. A client that goes away cancels the task that consumes the core's streams (before the response starts: here;
   during a stream: uvicorn); the streams are closed, which cancels the request in the core. APIError and
   RequestError are answered in OpenAI's error JSON (router/openai_serving.py maps codes to statuses); anything
   else is a 500 for that request only.

`/openapi.json` describes each POST body by its pydantic model and each answer, errors included (router/openapi.py).
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import json
import logging
import re
import time
from collections.abc import Awaitable, Iterable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from prometheus_client import Counter
from pydantic import BaseModel, ValidationError

from router import structured
from router.core import NOT_READY, SHUTTING_DOWN, RequestError, RouterCore
from router.openai_protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                    CompletionResponse, DetokenizeRequest, DetokenizeResponse, HealthStatus, ModelCard,
                                    ModelList, SimpleGenerateRequest, SimpleGenerateResponse, TokenizeRequest,
                                    TokenizeResponse)
from router.openapi import GENERATE_ERRORS, TOKENIZE_ERRORS, install, request_body, responses
from router.openai_serving import (APIError, ChatCompletions, Completions, Endpoint, SimpleGenerate, Streams,
                                   as_api_error, chat_prompt_ids, check_model, gather, stream)
from router.tool_calls import ToolConfig
from serving.auth import DEFAULT_OPEN_PATHS, ApiKey, ApiKeyMiddleware
from serving.metrics import Family, exposition
from serving.logs import tag_request

log = logging.getLogger("tandem.router.http")

try:
    _VERSION = importlib.metadata.version("tandem")
except importlib.metadata.PackageNotFoundError:  # a source tree that was never pip-installed (the GPU machine)
    _VERSION = "unknown"

# FastAPI's own OpenTelemetry spans (an HTTP span and one per dependency, endpoint and serialization of every
# request, whenever a tracer provider is installed) stay off: a request's trace is the router's llm_request span
# and the workers' (serving/tracing.py), whose parent is the client's traceparent as it was sent.
_NO_FRAMEWORK_TELEMETRY = ({"telemetry": dict(tracing=False, metrics=False, logs=False, operation_spans=False,
                                               auto_configure=False)}
                           if "telemetry" in inspect.signature(FastAPI).parameters else {})  # (older FastAPI: none)

HTTP_REQUESTS = Family(Counter, "http_requests", "HTTP requests answered by the router, by path and status code",
                       ("path", "status"))


DEFAULT_MAX_REQUEST_BYTES = 16 << 20


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, read only up to `limit` bytes: a larger one is 413 (a stated Content-Length before any is read);
    a client that goes away meanwhile is ClientGone."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes, more than the {limit} this server takes "
                            "(--max-request-bytes)", None, "request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the request body is more than the {limit} bytes this server takes "
                                    "(--max-request-bytes)", None, "request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


# A lone UTF-16 surrogate comes in as a \uD800-\uDFFF escape or as its UTF-8 bytes (json reads both): only a body
# where this matches is searched for one.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_SHOWN_CHARS = 200
# How pydantic names the member of a union an error is about ("str", "list[int]", "constrained-str"): not a field.
_UNION_MEMBER = re.compile(r"^(constrained-)?(str|int|float|bool|none|list\[.*\]|dict\[.*\])$")


def _shown(value) -> str:
    """repr(value), cut short: an error message quotes what it refuses, not megabytes of it."""
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(text)} characters)"


def _surrogate_at(s: str) -> int | None:
    """Where s has a lone UTF-16 surrogate (not valid Unicode), else None."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _check_text(data) -> None:
    """400 naming the first string (a value or a key) in `data` that is not valid Unicode, as the core words it."""
    todo = [([], data)]
    while todo:  # (iterative: the body may be nested as deep as json.loads goes)
        path, node = todo.pop()
        if isinstance(node, str) and (at := _surrogate_at(node)) is not None:
            where = ".".join(path)
            raise APIError(400, f"{where}: not valid text: a lone UTF-16 surrogate ({node[at]!r}) at character {at}",
                           path[0] if path else None, "invalid_value")
        if isinstance(node, dict):
            for key, value in node.items():
                if (at := _surrogate_at(key)) is not None:
                    where = ".".join(path) or "the body"
                    raise APIError(400, f"{where}: not valid text: a field name with a lone UTF-16 surrogate "
                                        f"({key[at]!r}) at character {at}", path[0] if path else None,
                                   "invalid_value")
                todo.append((path + [key], value))
        elif isinstance(node, list):
            todo.extend((path + [str(i)], value) for i, value in enumerate(node))


async def _parse(request: Request, model: type[BaseModel]):
    """The body as `model`; 400 for malformed JSON, text that is not valid Unicode, a wrong type or an OpenAI feature
    this server lacks, 413 for a body over the limit."""
    raw = await _read_body(request, request.app.state.max_request_bytes)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}", None, "invalid_json") from None
    except RecursionError:
        raise APIError(400, "malformed JSON in the request body: nested too deeply", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", None, "invalid_json")
    if _MAYBE_SURROGATE.search(raw):
        _check_text(data)
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        # Of a union's errors (one per member), the one that says most: a bound broken rather than a type mismatch,
        # then the member that got deepest into the value.
        err = min(e.errors(), key=lambda x: (x["type"].endswith(("_type", "_parsing")), -len(x["loc"])))
        where = ".".join(str(part) for part in err["loc"] if not _UNION_MEMBER.match(str(part)))
        param = str(err["loc"][0]) if err["loc"] else None
        raise APIError(400, f"{where}: {err['msg']} (got {_shown(err.get('input'))})", param,
                       "invalid_type") from None
    if (name := body.unsupported_field()) is not None:
        raise APIError(400, f"{name}={_shown(getattr(body, name))}: not supported by this server; leave it out",
                       name, "unsupported")
    await structured.prepare(body)  # (a constraint is checked off the event loop)
    return body


def _error_response(err: APIError) -> Response:
    # json.dumps escapes what is not ASCII, so a message quoting any text the client sent always renders.
    return Response(json.dumps(err.body()), status_code=err.status, media_type="application/json",
                    headers=err.headers())


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


# ---------------------------------------------------------------------------------------------------- the app
def create_app(core: RouterCore, api_key: ApiKey | None = None, open_paths: Iterable[str] = DEFAULT_OPEN_PATHS,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tools: ToolConfig = ToolConfig()) -> FastAPI:
    """The app over `core`; with `api_key`, every path but `open_paths` needs `Authorization: Bearer <key>`; bodies
    over max_request_bytes are refused (413) before they are parsed; `tools`: the tool-calling flags."""
    app = FastAPI(title="Tandem router", summary="OpenAI-compatible API over disaggregated prefill and decode",
                  docs_url=None, redoc_url=None, **_NO_FRAMEWORK_TELEMETRY)
    app.state.max_request_bytes = max_request_bytes
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    app.add_middleware(_CountRequests)  # (the outer one: refusals are counted too)
    tokenizer = core.tokenizer

    @app.exception_handler(APIError)
    @app.exception_handler(RequestError)
    async def on_api_error(_: Request, e: APIError | RequestError) -> Response:
        return _error_response(as_api_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> Response:
        # Starlette's own answers (no such route: 404, a route without this method: 405) in OpenAI's shape, so that
        # clients print the message, not only the status.
        if e.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route on this server"
        elif e.status_code == 405:
            allowed = next((v for k, v in (e.headers or {}).items() if k.lower() == "allow"), None)
            message = f"{request.method} {request.url.path}: method not allowed" + (
                f" (allowed: {allowed})" if allowed else "")
        else:
            message = str(e.detail)
        err = APIError(e.status_code, message, None, {404: "not_found", 405: "method_not_allowed"}.get(e.status_code))
        response = _error_response(err)
        if e.headers:
            response.headers.update(e.headers)
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, e: RequestValidationError) -> Response:
        # (bodies are validated in _parse; this is a path or query parameter): 400 naming it, as vLLM answers
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(part) for part in err["loc"][1:]) or "request"
        return _error_response(APIError(400, f"{where}: {err['msg']}", where, "invalid_value"))

    @app.exception_handler(ClientGone)
    async def on_client_gone(_: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, e: Exception) -> Response:
        log.exception("unexpected error")
        return _error_response(as_api_error(e))

    async def serve(request: Request, endpoint: Endpoint) -> Response:
        if endpoint.requests:  # (a batch's requests are <rid>-<i>: its lines carry <rid>)
            tag_request(getattr(endpoint, "rid", None) or endpoint.requests[0].request_id)
        # The client's trace context (a traced gateway's `traceparent`): the parent of the request's span.
        trace_headers = {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k))} or None
        for req in endpoint.requests:
            req.trace_headers = trace_headers
        core.check_fan_out(len(endpoint.requests), endpoint.requests[0].params.n if endpoint.requests else 1)
        streams = await _unless_disconnected(request, Streams.open(core, endpoint.requests))
        if endpoint.stream:
            return StreamingResponse(stream(streams, endpoint), media_type=endpoint.media_type)
        choices, usage = await _unless_disconnected(request, gather(streams))
        return JSONResponse(endpoint.response(choices, usage))

    # ------------------------------------------------------------------------------------------ info routes
    @app.get("/health", responses={200: {"model": HealthStatus, "description": "ready to serve"},
                                   503: {"model": HealthStatus, "description": "not ready: `reason` says why"}})
    async def health() -> Response:
        if core.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": SHUTTING_DOWN if core.draining else NOT_READY},
                            status_code=503)

    @app.get("/livez", responses={200: {"model": HealthStatus,
                                        "description": "this process is alive and its event loop turns"}})
    async def livez() -> Response:
        # Liveness (Kubernetes' livenessProbe): answered by the event loop alone, whatever the instances' state, so
        # a worker outage makes routers unready (/health 503) but never gets them restarted.
        return JSONResponse({"status": "ok"})

    @app.post("/ping", include_in_schema=False)  # (the GET below documents it)
    @app.get("/ping", responses={200: {"model": HealthStatus, "description": "ready to serve"},
                                 503: {"model": HealthStatus, "description": "not ready: `reason` says why"}})
    async def ping() -> Response:
        """SageMaker's health check (GET or POST), answered as /health."""
        return await health()

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus' text format"}})
    async def metrics() -> Response:
        body, content_type = exposition()  # text 0.0.4 whatever the scraper asks for, as the workers'
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/v1/models", responses=responses(None, (401,)))
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, max_model_len=core.max_model_len) for name in core.models()])

    @app.get("/v1/models/{model_id:path}", responses=responses(None, (401, 404)))
    async def model(model_id: str) -> ModelCard:
        if model_id not in core.models():
            raise APIError(404, f"The model `{model_id}` does not exist. Served: {', '.join(core.models())}",
                           "model", "model_not_found")
        return ModelCard(id=model_id, max_model_len=core.max_model_len)

    @app.get("/version", responses=responses(None, (401,)))
    async def version() -> dict:
        return {"version": _VERSION}

    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest),
              responses=responses(TokenizeResponse, TOKENIZE_ERRORS))
    async def tokenize(request: Request) -> TokenizeResponse:
        body: TokenizeRequest = await _parse(request, TokenizeRequest)
        check_model(core, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "prompt, messages: give exactly one of them", "prompt", "invalid_value")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages: must not be empty", "messages", "invalid_value")
            ids = await chat_prompt_ids(core, body)
        else:
            ids = await core.tokenize(body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=core.max_model_len, tokens=list(ids))

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest),
              responses=responses(DetokenizeResponse, TOKENIZE_ERRORS))
    async def detokenize(request: Request) -> DetokenizeResponse:
        body: DetokenizeRequest = await _parse(request, DetokenizeRequest)
        check_model(core, body.model)
        if len(body.tokens) > core.max_model_len:  # (as vLLM's; decoding millions of ids would hold the event loop)
            raise APIError(400, f"tokens: {len(body.tokens)} ids, more than max_model_len={core.max_model_len}, the "
                                "most a prompt and its completion have", "tokens", "invalid_value")
        bad = next((t for t in body.tokens if not 0 <= t < core.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {core.vocab_size})", "tokens",
                           "invalid_value")
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))

    # ------------------------------------------------------------------------------------------ generation
    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest),
              responses=responses(CompletionResponse, GENERATE_ERRORS, stream="text/event-stream"))
    async def completions(request: Request) -> Response:
        t_in = time.monotonic_ns()
        return await serve(request, await Completions.create(core, await _parse(request, CompletionRequest), t_in))

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest),
              responses=responses(ChatCompletionResponse, GENERATE_ERRORS, stream="text/event-stream"))
    async def chat_completions(request: Request) -> Response:
        t_in = time.monotonic_ns()
        return await serve(request, await ChatCompletions.create(core, await _parse(request, ChatCompletionRequest),
                                                                 t_in, tools))

    @app.post("/generate", openapi_extra=request_body(SimpleGenerateRequest),
              responses=responses(SimpleGenerateResponse, GENERATE_ERRORS))
    async def generate(request: Request) -> Response:
        """vLLM's simple API (router/openai_serving.py: SimpleGenerate)."""
        return await serve(request, SimpleGenerate(core, await _parse(request, SimpleGenerateRequest)))

    install(app, [CompletionRequest, ChatCompletionRequest, SimpleGenerateRequest, TokenizeRequest, DetokenizeRequest])
    return app


_COUNTED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate", "/v1/models", "/health",
                            "/livez", "/ping", "/metrics"})


class _CountRequests:
    """ASGI middleware counting answered requests in <prefix>:http_requests (streams count when they start)."""

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
