"""The tandem.v1.Decode servicer: protobuf in, DecodeCore, protobuf out. Errors become status codes in
protos.runtime.grpc_method.

`add_to_server` registers it with the generated handlers except one: TransferKv's messages are parsed by
`KvReceiver.deserialize`, which hands KvBlocks over with a payload that is a view of the received bytes (protobuf's
parser would copy it twice). DecodeCore takes either form, so the generated `add_DecodeServicer_to_server` works too,
only slower.
"""
from __future__ import annotations

import grpc

from decode_svc.core import DecodeCore
from kv_transfer.receiver import KvReceiver
from protos.tandem.v1 import common_pb2, decode_pb2, decode_pb2_grpc, kv_transfer_pb2
from serving.errors import grpc_method

SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name


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


def add_to_server(core: DecodeCore, server: grpc.aio.Server) -> None:
    """Serves tandem.v1.Decode from `core` on `server`."""
    s = DecodeServicer(core)
    handlers = {
        "Decode": grpc.unary_stream_rpc_method_handler(
            s.Decode, request_deserializer=decode_pb2.DecodeRequest.FromString,
            response_serializer=decode_pb2.DecodeResponse.SerializeToString),
        "TransferKv": grpc.stream_unary_rpc_method_handler(
            s.TransferKv, request_deserializer=KvReceiver.deserialize,
            response_serializer=kv_transfer_pb2.KvTransferAck.SerializeToString),
        "KvHandshake": grpc.unary_unary_rpc_method_handler(
            s.KvHandshake, request_deserializer=kv_transfer_pb2.KvHandshakeRequest.FromString,
            response_serializer=kv_transfer_pb2.KvHandshakeResponse.SerializeToString),
        "GetLoad": grpc.unary_unary_rpc_method_handler(
            s.GetLoad, request_deserializer=common_pb2.GetLoadRequest.FromString,
            response_serializer=common_pb2.InstanceLoad.SerializeToString),
    }
    assert set(handlers) == set(decode_pb2.DESCRIPTOR.services_by_name["Decode"].methods_by_name), \
        "a Decode method without a handler"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
