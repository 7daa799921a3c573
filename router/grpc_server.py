"""The public gRPC API (tandem.v1.Generate) over a RouterCore, with grpc.health.v1 and reflection (v1 and v1alpha).

A thin servicer: protobuf -> GenerateRequest (SamplingParams validates and names the field), RouterCore.generate,
GenerateDelta -> protobuf. Chat renders its messages (and tools) first, with the HTTP chat endpoint's code
(router/chat_template.py; the proto read as the HTTP body is, router/grpc_chat.py), holds a required or named
tool_choice to its grammar, then streams as Generate, each completion's text through its tool-call stream
(content and tool_calls beside delta.text; FINISH_REASON_TOOL_CALLS once calls were made). RequestError and ValueError become status codes in serving.errors.grpc_method (the one
place): invalid_argument -> INVALID_ARGUMENT, not_found -> NOT_FOUND, resource_exhausted -> RESOURCE_EXHAUSTED,
unavailable -> UNAVAILABLE, anything else -> INTERNAL (a refusal under load carries trailing metadata retry-after,
router/admission.py). A client's cancel cancels the handler, which closes the core's stream and so cancels the request
in its backend (on the prefill and decode services, or in the colocated engine).
"""
from __future__ import annotations

import asyncio
import uuid

import grpc

from protos.tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from router.chat_template import Chat, ChatTemplateError, kwargs_from_json, prompt_ids, template_messages
from router.core import GenerateRequest, RequestError, RouterCore
from router.grpc_chat import ChatTools, ProtoCalls, messages_from_proto, tool_choice_from_proto
from router.tool_calls import ToolChoiceError, ToolConfig, constrained
from serving.auth import ApiKey, ApiKeyInterceptor
from serving.convert import finish_to_proto, logprobs_to_proto, sampling_from_proto_off_loop
from serving.errors import grpc_method, shown
from serving.logs import tag_request
from serving.rpc import RequestLimit, add_health_and_reflection, add_port, add_service, new_server, set_serving
from serving.tls import TlsConfig

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name
# The largest request message of the public API (a prompt of ~16 million characters; the HTTP API's body limit is
# the same, router/http.py). The workers' internal servers take KV blocks, up to serving.rpc.MAX_MESSAGE_BYTES.
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
MAX_MESSAGE_FLAG = "--max-grpc-message-bytes"


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, core: RouterCore, tool_config: ToolConfig = ToolConfig()):
        self.core, self.tool_config = core, tool_config

    def _model(self, name: str) -> str:
        return name or self.core.models()[0]

    def _served(self, name: str) -> str:
        model = self._model(name)
        if model not in self.core.models():
            raise RequestError("not_found", "model", f"model={shown(model)}: not served here")
        return model

    @grpc_method
    async def Generate(self, request, context):
        params = await sampling_from_proto_off_loop(request.params)
        if request.prompt and request.prompt_token_ids:
            raise RequestError("invalid_argument", "prompt", "prompt: give exactly one of prompt and prompt_token_ids")
        rid = "cmpl-" + uuid.uuid4().hex
        tag_request(rid)
        req = GenerateRequest(request_id=rid, model=self._model(request.model),
                              prompt=None if request.prompt_token_ids else request.prompt,
                              prompt_token_ids=list(request.prompt_token_ids) or None, params=params,
                              trace_headers=_trace(context), return_timings=request.return_timings)
        prompt_ids = None
        if request.return_prompt_token_ids:
            # (a text prompt tokenized here as the core tokenizes it, as the HTTP completions endpoint does; an
            # empty one is left for the core to refuse, naming prompt)
            prompt_ids = req.prompt_token_ids or (await self.core.tokenize(req.prompt, "prompt") if req.prompt else [])
        async for response in self._stream(req, prompt_ids):
            yield response

    @grpc_method
    async def Chat(self, request, context):
        await sampling_from_proto_off_loop(request.params)  # (a bad value is refused before the template runs)
        model = self._served(request.model)
        tools = ChatTools.of(request, self.tool_config)
        try:
            messages = template_messages(messages_from_proto(request.messages))
        except ChatTemplateError as e:
            raise RequestError("invalid_argument", e.field, str(e)) from None
        chat = Chat(messages=messages, tools=tools.tools,
                    add_generation_prompt=(request.add_generation_prompt if request.HasField("add_generation_prompt")
                                           else not request.continue_final_message),
                    continue_final_message=request.continue_final_message,
                    chat_template_kwargs=kwargs_from_json(request.chat_template_kwargs_json))
        ids = await prompt_ids(self.core, chat)
        self.core.check_token_ids(ids, "messages")  # (the core would name prompt_token_ids, which the client never set)
        # Unset max_tokens: the rest of the context, as the HTTP chat endpoint (the core refuses a prompt that fills
        # it).
        rest = {} if request.params.HasField("max_tokens") else {
            "max_tokens": max(1, self.core.max_model_len - len(ids))}
        params = await sampling_from_proto_off_loop(request.params, **rest)
        if tools.choice.schema is not None:  # tool_choice required or named: the grammar makes the call(s)
            try:
                params = constrained(params, tools.choice.schema, tool_choice_from_proto(request))
            except ToolChoiceError as e:
                raise RequestError("invalid_argument", e.field, str(e)) from None
        rid = "chatcmpl-" + uuid.uuid4().hex
        tag_request(rid)
        req = GenerateRequest(request_id=rid, model=model, prompt=None, prompt_token_ids=ids, params=params,
                              trace_headers=_trace(context), return_timings=request.return_timings)
        async for response in self._stream(req, ids if request.return_prompt_token_ids else None,
                                           ProtoCalls(tools.choice)):
            yield response

    async def _stream(self, req: GenerateRequest, prompt_ids: list[int] | None = None,
                      calls: ProtoCalls | None = None):
        rid = req.request_id
        started: set[int] = set()  # completions that have had their first response
        async for d in self.core.generate(req):
            response = generate_pb2.GenerateResponse(
                request_id=rid, index=d.index,
                usage=generate_pb2.Usage(prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens,
                                         cached_prompt_tokens=d.cached_tokens),
                timings=generate_pb2.RequestTimings(**d.timings) if d.timings else None)
            finish = d.finish_reason
            if calls is not None:
                finish = calls.add(response, d.text, finish)
            delta = response.delta
            delta.token_ids.extend(d.token_ids)
            delta.text, delta.num_output_tokens = d.text, d.completion_tokens
            delta.stop_reason = "" if d.stop_reason is None else str(d.stop_reason)
            if finish:
                delta.finish_reason = (common_pb2.FINISH_REASON_TOOL_CALLS if finish == "tool_calls"
                                       else finish_to_proto(finish))
            if d.logprobs:
                delta.logprobs.extend(logprobs_to_proto(d.logprobs, d.token_ids))
            if prompt_ids is not None and d.index not in started:
                response.prompt_token_ids.extend(prompt_ids)
            started.add(d.index)
            yield response

    @grpc_method
    async def Tokenize(self, request, context):
        self._served(request.model)
        return generate_pb2.TokenizeResponse(token_ids=await self.core.tokenize(request.text))

    @grpc_method
    async def ListModels(self, request, context):
        return generate_pb2.ListModelsResponse(models=self.core.models(), max_model_len=self.core.max_model_len)


def _trace(context) -> dict[str, str] | None:
    """The call's W3C trace context (gRPC metadata), the parent of the request's span."""
    trace = {k: v for k, v in (context.invocation_metadata() or ()) if k in ("traceparent", "tracestate")}
    return trace or None


async def start_grpc_server(core: RouterCore, address: str, tls: TlsConfig | None = None,
                            api_key: ApiKey | None = None,
                            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                            tool_config: ToolConfig = ToolConfig()) -> grpc.aio.Server:
    """Starts the public API on address ("host:port"), TLS with `tls` (no client certificate asked: clients of the
    public API are not Tandem processes), calls without `api_key` refused (health and reflection stay open), request
    messages over max_message_bytes refused (RESOURCE_EXHAUSTED naming --max-grpc-message-bytes); the caller stops
    it with `await server.stop(grace)`. tool_config: the router's tool-calling flags (Chat's tool_choice "auto")."""
    limit = RequestLimit(max_message_bytes, MAX_MESSAGE_FLAG)
    server = new_server([ApiKeyInterceptor(api_key, [SERVICE_NAME])] if api_key else [], limit=limit)
    add_service(server, generate_pb2.DESCRIPTOR.services_by_name["Generate"], GenerateServicer(core, tool_config),
                limit=limit)
    hs = add_health_and_reflection(server, [SERVICE_NAME], limit=limit)
    add_port(server, address, tls, require_client_auth=False)
    await server.start()
    await set_serving(hs, [SERVICE_NAME], core.ready())
    server._tandem_health_task = asyncio.create_task(_follow_readiness(core, hs))  # ends with the event loop
    return server


async def _follow_readiness(core: RouterCore, hs) -> None:
    """grpc.health.v1 answers SERVING only while the core is ready (as HTTP /health)."""
    ready = None
    while True:
        now = core.ready()
        if now != ready:
            await set_serving(hs, [SERVICE_NAME], now)
            ready = now
        await asyncio.sleep(0.5)
