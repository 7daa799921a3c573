"""The tandem.v1.Decode servicer: protobuf in, DecodeCore, protobuf out. Errors become status codes in
protos.runtime.grpc_method."""
from __future__ import annotations

from decode_svc.core import DecodeCore
from protos.runtime import grpc_method
from protos.tandem.v1 import decode_pb2_grpc


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, core: DecodeCore):
        self.core = core

    @grpc_method
    async def Decode(self, request, context):
        timeout = request.kv_transfer_timeout_ms / 1000 if request.kv_transfer_timeout_ms else None
        async for resp in self.core.decode(request.request_id, list(request.prompt_token_ids), request.params,
                                           timeout):
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
