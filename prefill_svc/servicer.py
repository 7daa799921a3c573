"""The tandem.v1.Prefill servicer: protobuf in, PrefillCore, protobuf out. Errors become status codes in
serving.errors.grpc_method; requests are parsed by serving.rpc.add_service (malformed: INVALID_ARGUMENT). Each call
is one `prefill` span (serving/tracing.py; its parent comes in the call's metadata), the KV transfer's span under it,
and its log lines carry the request id."""
from __future__ import annotations

from opentelemetry import trace

from prefill_svc.core import PrefillCore
from protos.tandem.v1 import prefill_pb2_grpc
from serving import tracing
from serving.errors import grpc_method
from serving.logs import tag_request
from serving.tracing import SpanAttributes as A


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, core: PrefillCore):
        self.core = core

    @grpc_method
    async def Prefill(self, request, context):
        tag_request(request.request_id[:256])
        timeout = request.kv_transfer_timeout_ms / 1000 if request.kv_transfer_timeout_ms else None
        with tracing.server_span("prefill", context, {
                A.ATTEMPT_ID: request.request_id, A.PROMPT_TOKENS: len(request.prompt_token_ids),
                A.KV_PEER: request.decode_address}) as span:
            async for resp in self.core.prefill(request.request_id, list(request.prompt_token_ids), request.params,
                                                request.decode_address, timeout,
                                                list(request.prior_output_token_ids),
                                                trace_context=trace.set_span_in_context(span)):
                if resp.HasField("first_token"):
                    span.add_event("first_token")
                    span.set_attribute(A.CACHED_TOKENS, resp.first_token.num_cached_tokens)
                else:
                    td = resp.transfer_done
                    span.set_attributes({A.KV_BYTES: td.transfer_bytes, A.KV_BLOCKS: td.num_blocks,
                                         A.KV_SECONDS: td.transfer_seconds})
                yield resp

    @grpc_method
    async def GetLoad(self, request, context):
        return await self.core.load()
