"""serving/reflection.py: every Tandem server answers server reflection in both versions, grpc.reflection.v1 (what
grpcurl and current gRPC libraries ask first) and v1alpha, with the same services and the same descriptors; a v1
client resolves a Tandem service down to its messages."""
from __future__ import annotations

import asyncio
import socket

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from protos.tandem.v1 import generate_pb2
from serving import reflection
from serving.rpc import add_health_and_reflection, add_port, new_server

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name
RAW = dict(request_serializer=None, response_deserializer=None)
V1_METHOD = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _v1alpha_client(address: str):
    """grpcio-reflection's own client (v1alpha): the services, and Generate's method and message descriptors built
    from what the server sent (a pool of its own, so nothing comes from this process's imports)."""
    with grpc.insecure_channel(address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        pool = descriptor_pool.DescriptorPool(db)
        services = sorted(db.get_services())
        method = pool.FindServiceByName(SERVICE).methods_by_name["Generate"]
        return services, method.input_type.full_name, [f.name for f in method.input_type.fields]


async def _v1_client(ch, *requests):
    """Raw grpc.reflection.v1 messages on one stream."""
    async def gen():
        for r in requests:
            yield r.SerializeToString()

    call = ch.stream_stream(V1_METHOD, **RAW)(gen())
    return [reflection.V1ServerReflectionResponse.FromString(raw) async for raw in call]


def test_v1_and_v1alpha_list_and_describe_the_same():
    async def main():
        address = f"127.0.0.1:{_port()}"
        server = new_server()
        add_health_and_reflection(server, [SERVICE])
        add_port(server, address)
        await server.start()
        try:
            alpha = await asyncio.to_thread(_v1alpha_client, address)
            async with grpc.aio.insecure_channel(address) as ch:
                v1 = await _v1_client(ch, reflection.V1ServerReflectionRequest(list_services=""),
                                      reflection.V1ServerReflectionRequest(file_containing_symbol=SERVICE),
                                      reflection.V1ServerReflectionRequest(file_containing_symbol="tandem.v1.Nope"),
                                      reflection.V1ServerReflectionRequest(
                                          file_containing_symbol=reflection.V1_SERVICE))
            return alpha, v1
        finally:
            await server.stop(0)

    (alpha_services, input_type, input_fields), (listed, found, missing, itself) = asyncio.run(main())
    v1_services = sorted(s.name for s in listed.list_services_response.service)
    assert v1_services == alpha_services == sorted([SERVICE, "grpc.health.v1.Health", reflection.V1_SERVICE,
                                                    reflection.V1ALPHA_SERVICE])
    assert (input_type, input_fields) == ("tandem.v1.GenerateRequest",
                                          ["model", "prompt", "prompt_token_ids", "params", "return_timings",
                                           "return_prompt_token_ids"])
    files = {}
    for raw in found.file_descriptor_response.file_descriptor_proto:
        fdp = descriptor_pb2.FileDescriptorProto.FromString(raw)
        files[fdp.name] = fdp
    assert set(files) == {"tandem/v1/generate.proto", "tandem/v1/common.proto"}
    assert found.original_request.file_containing_symbol == SERVICE
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
    described = descriptor_pb2.FileDescriptorProto.FromString(itself.file_descriptor_response.file_descriptor_proto[0])
    assert (described.name, described.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    assert described.service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"


def test_v1_messages_have_v1alpha_fields():
    """The v1 descriptor is v1alpha's renamed: same field names and numbers in every message (what lets the v1
    servicer pass bytes through)."""
    for name, alpha in reflection_pb2.DESCRIPTOR.message_types_by_name.items():
        v1 = reflection.V1_DESCRIPTOR.message_types_by_name[name]
        assert [(f.name, f.number, f.type) for f in v1.fields] == [(f.name, f.number, f.type) for f in alpha.fields]
