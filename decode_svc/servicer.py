"""The tandem.v1.Decode servicer: protobuf in, DecodeCore, protobuf out. Errors become status codes in
serving.errors.grpc_method.

`add_to_server` registers it through serving.rpc.add_service, which parses each request inside the call (malformed
bytes: INVALID_ARGUMENT). TransferKv's messages are parsed by `KvReceiver.deserialize`, which hands KvBlocks over
with a payload that is a view of the received bytes (protobuf's parser would copy it twice). DecodeCore takes either
form, so the generated `add_DecodeServicer_to_server` works too, only slower.

Each Decode call is one `decode` span and each TransferKv one `kv_transfer.receive` span (serving/tracing.py; their
parents come in the calls' metadata: the router's request, the prefill's transfer); their log lines carry the
request id.
"""
from __future__ import annotations

import grpc

from decode_svc.core import DecodeCore
from kv_transfer.receiver import KvReceiver
from kv_transfer.registry import PATH_LABELS
from protos.tandem.v1 import decode_pb2, decode_pb2_grpc
from serving import tracing
from serving.errors import grpc_method
from serving.logs import tag_request
from serving.rpc import add_service
from serving.tracing import SpanAttributes as A

SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"]


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, core: DecodeCore):
        self.core = core

    @grpc_method
    async def Decode(self, request, context):
        tag_request(request.request_id[:256])
        timeout = request.kv_transfer_timeout_ms / 1000 if request.kv_transfer_timeout_ms else None
        with tracing.server_span("decode", context, {A.ATTEMPT_ID: request.request_id,
                                                     A.PROMPT_TOKENS: len(request.prompt_token_ids)}) as span:
            first = True
            async for resp in self.core.decode(request.request_id, list(request.prompt_token_ids), request.params,
                                               timeout, list(request.prior_output_token_ids),
                                               request.prefill_locally):
                if resp.HasField("reserved"):
                    span.set_attribute(A.RESERVED_BLOCKS, resp.reserved.num_blocks)
                elif first and resp.delta.token_ids:
                    span.add_event("first_token")  # (decode's first: the prefill's came before, unless local)
                    first = False
                if resp.delta.finish_reason:
                    span.set_attribute(A.COMPLETION_TOKENS, resp.delta.num_output_tokens)
                    tracing.answered(span)  # (the router may end the call as soon as it has this delta)
                yield resp

    @grpc_method
    async def TransferKv(self, request_iterator, context):
        with tracing.server_span("kv_transfer.receive", context) as span:
            ack = await self.core.transfer(request_iterator.__aiter__())
            span.set_attributes({A.ATTEMPT_ID: ack.request_id, A.KV_BYTES: ack.received_bytes,
                                 A.KV_BLOCKS: ack.num_blocks, A.KV_PATH: PATH_LABELS.get(ack.path, str(ack.path))})
            return ack

    @grpc_method
    async def KvHandshake(self, request, context):
        return await self.core.handshake(request)

    @grpc_method
    async def GetLoad(self, request, context):
        return await self.core.load()


def add_to_server(core: DecodeCore, server: grpc.aio.Server) -> None:
    """Serves tandem.v1.Decode from `core` on `server` (TransferKv's messages through KvReceiver.deserialize)."""
    add_service(server, SERVICE, DecodeServicer(core), parsers={"TransferKv": KvReceiver.deserialize})
