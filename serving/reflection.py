"""Server reflection, both versions clients speak: grpc.reflection.v1 (grpcurl, Postman and current gRPC libraries
ask for it first) and grpc.reflection.v1alpha (older clients; grpcio-reflection's servicer).

grpcio-reflection ships only v1alpha. The v1 protocol is the same messages under another package (grpc's
src/proto/grpc/reflection/v1/reflection.proto: same fields, same numbers), so its descriptor is built here from the
v1alpha one, renamed, and the v1 servicer hands each request to the v1alpha servicer as the same bytes and sends its
answer back the same way: the wire format does not carry the package name.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # "grpc.reflection.v1alpha.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"
_V1_PACKAGE = "grpc.reflection.v1"


def _v1_file():
    """The v1 reflection.proto's descriptor (in the default pool, so that reflection itself can describe it)."""
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(_V1_FILE)
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    old = "." + fdp.package + "."
    fdp.name, fdp.package = _V1_FILE, _V1_PACKAGE
    for message in fdp.message_type:
        for f in message.field:
            if f.HasField("type_name"):  # (messages only: a scalar field with one set, even empty, is invalid)
                f.type_name = f.type_name.replace(old, f".{_V1_PACKAGE}.")
    for service in fdp.service:
        for m in service.method:
            m.input_type = m.input_type.replace(old, f".{_V1_PACKAGE}.")
            m.output_type = m.output_type.replace(old, f".{_V1_PACKAGE}.")
    # The options of grpc's own v1 file.
    fdp.options.Clear()
    fdp.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    fdp.options.java_package = "io.grpc.reflection.v1"
    fdp.options.java_multiple_files = True
    fdp.options.java_outer_classname = "ServerReflectionProto"
    pool.Add(fdp)
    return pool.FindFileByName(_V1_FILE)


V1_DESCRIPTOR = _v1_file()
V1_SERVICE_DESCRIPTOR = V1_DESCRIPTOR.services_by_name["ServerReflection"]
V1_SERVICE = V1_SERVICE_DESCRIPTOR.full_name  # "grpc.reflection.v1.ServerReflection"
V1ServerReflectionRequest = GetMessageClass(V1_DESCRIPTOR.message_types_by_name["ServerReflectionRequest"])
V1ServerReflectionResponse = GetMessageClass(V1_DESCRIPTOR.message_types_by_name["ServerReflectionResponse"])
SERVICES = (V1_SERVICE, V1ALPHA_SERVICE)


def servicers(service_names: Iterable[str]) -> list[tuple[object, object]]:
    """(ServiceDescriptor, servicer) for v1 and v1alpha, each listing service_names and both reflection services."""
    alpha = reflection.aio.ReflectionServicer([*service_names, *SERVICES])
    return [(V1_SERVICE_DESCRIPTOR, _V1Servicer(alpha)),
            (reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"], alpha)]


class _V1Servicer:
    """grpc.reflection.v1.ServerReflection through a v1alpha servicer (module docstring)."""

    def __init__(self, alpha: reflection.aio.ReflectionServicer):
        self.alpha = alpha

    async def ServerReflectionInfo(self, requests, context) -> AsyncIterator:
        async def as_alpha():
            async for r in requests:
                yield reflection_pb2.ServerReflectionRequest.FromString(r.SerializeToString())

        async for response in self.alpha.ServerReflectionInfo(as_alpha(), context):
            yield V1ServerReflectionResponse.FromString(response.SerializeToString())
