"""The public gRPC API (tandem.v1.Generate) over a RouterCore, with grpc.health.v1 and reflection.

A thin servicer: protobuf -> GenerateRequest (SamplingParams validates and names the field), RouterCore.generate,
GenerateDelta -> protobuf. RequestError and ValueError become status codes in serving.errors.grpc_method (the one
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
from router.core import GenerateRequest, RequestError, RouterCore
from serving.auth import ApiKey, ApiKeyInterceptor
from serving.convert import finish_to_proto, logprobs_to_proto, sampling_from_proto_off_loop
from serving.errors import grpc_method, shown
from serving.rpc import RequestLimit, add_health_and_reflection, add_port, add_service, new_server, set_serving
from serving.tls import TlsConfig

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name
# The largest request message of the public API (a prompt of ~16 million characters; the HTTP API's body limit is
# the same, router/http.py). The workers' internal servers take KV blocks, up to serving.rpc.MAX_MESSAGE_BYTES.
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20
MAX_MESSAGE_FLAG = "--max-grpc-message-bytes"


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, core: RouterCore):
        self.core = core

    def _model(self, name: str) -> str:
        return name or self.core.models()[0]

    @grpc_method
    async def Generate(self, request, context):
        params = await sampling_from_proto_off_loop(request.params)
        if request.prompt and request.prompt_token_ids:
            raise RequestError("invalid_argument", "prompt", "prompt: give exactly one of prompt and prompt_token_ids")
        rid = "cmpl-" + uuid.uuid4().hex
        req = GenerateRequest(request_id=rid, model=self._model(request.model),
                              prompt=None if request.prompt_token_ids else request.prompt,
                              prompt_token_ids=list(request.prompt_token_ids) or None, params=params)
        async for d in self.core.generate(req):
            delta = common_pb2.TokenDelta(token_ids=d.token_ids, text=d.text,
                                          finish_reason=finish_to_proto(d.finish_reason) if d.finish_reason else 0,
                                          num_output_tokens=d.completion_tokens)
            if d.logprobs:
                delta.logprobs.extend(logprobs_to_proto(d.logprobs, d.token_ids))
            yield generate_pb2.GenerateResponse(
                request_id=rid, index=d.index, delta=delta,
                usage=generate_pb2.Usage(prompt_tokens=d.prompt_tokens, completion_tokens=d.completion_tokens))

    @grpc_method
    async def Tokenize(self, request, context):
        model = self._model(request.model)
        if model not in self.core.models():
            raise RequestError("not_found", "model", f"model={shown(model)}: not served here")
        return generate_pb2.TokenizeResponse(token_ids=await self.core.tokenize(request.text))

    @grpc_method
    async def ListModels(self, request, context):
        return generate_pb2.ListModelsResponse(models=self.core.models(), max_model_len=self.core.max_model_len)


async def start_grpc_server(core: RouterCore, address: str, tls: TlsConfig | None = None,
                            api_key: ApiKey | None = None,
                            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.aio.Server:
    """Starts the public API on address ("host:port"), TLS with `tls` (no client certificate asked: clients of the
    public API are not Tandem processes), calls without `api_key` refused (health and reflection stay open), request
    messages over max_message_bytes refused (RESOURCE_EXHAUSTED naming --max-grpc-message-bytes); the caller stops
    it with `await server.stop(grace)`."""
    limit = RequestLimit(max_message_bytes, MAX_MESSAGE_FLAG)
    server = new_server([ApiKeyInterceptor(api_key, [SERVICE_NAME])] if api_key else [], limit=limit)
    add_service(server, generate_pb2.DESCRIPTOR.services_by_name["Generate"], GenerateServicer(core), limit=limit)
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
