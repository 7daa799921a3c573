"""The tandem.v1.Decode servicer: protobuf in, DecodeCore, protobuf out. Errors become status codes in
serving.errors.grpc_method.

`add_to_server` registers it through serving.rpc.add_service, which parses each request inside the call (malformed
bytes: INVALID_ARGUMENT). TransferKv's messages are parsed by `KvReceiver.deserialize`, which hands KvBlocks over
with a payload that is a view of the received bytes (protobuf's parser would copy it twice). DecodeCore takes either
form, so the generated `add_DecodeServicer_to_server` works too, only slower.
"""
from __future__ import annotations

import grpc

from decode_svc.core import DecodeCore
from kv_transfer.receiver import KvReceiver
from protos.tandem.v1 import decode_pb2, decode_pb2_grpc
from serving.errors import grpc_method
from serving.rpc import add_service

SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"]


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, core: DecodeCore):
        self.core = core

    @grpc_method
    async def Decode(self, request, context):
        timeout = request.kv_transfer_timeout_ms / 1000 if request.kv_transfer_timeout_ms else None
        async for resp in self.core.decode(request.request_id, list(request.prompt_token_ids), request.params,
                                           timeout, list(request.prior_output_token_ids), request.prefill_locally):
            yield resp

    @grpc_method
    async def TransferKv(self, request_iterator, context):
        return await self.core.transfer(request_iterator.__aiter__())

    @grpc_method
    async def KvHandshake(self, request, context):
        return await self.core.handshake(request)

    @grpc_method
    async def GetLoad(self, request, context):
        return await self.core.load()


def add_to_server(core: DecodeCore, server: grpc.aio.Server) -> None:
    """Serves tandem.v1.Decode from `core` on `server` (TransferKv's messages through KvReceiver.deserialize)."""
    add_service(server, SERVICE, DecodeServicer(core), parsers={"TransferKv": KvReceiver.deserialize})
