"""serving/health.py: the hand-encoded grpc.health.v1 Check agrees with the generated messages, and the fallback
server (used where grpcio-health-checking is missing) answers both the standard stub and our client. Health and
reflection as every Tandem server has them (serving.rpc.add_health_and_reflection): bytes that are no request are
INVALID_ARGUMENT, an unknown service NOT_FOUND with a message; nothing is UNKNOWN."""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpc_reflection.v1alpha import reflection_pb2

from serving import health
from serving.rpc import add_health_and_reflection, add_port, new_server, set_serving

GARBAGE = [b"\x0a\x05ab", b"\x0f", b"\x0a\x02\xff\xfe", b"\x80"]  # a cut field, wire type 7, bad UTF-8, a cut varint
RAW = dict(request_serializer=None, response_deserializer=None)


@pytest.mark.parametrize("service", ["", "tandem.v1.Prefill", "x" * 300])
def test_request_codec_matches_generated_messages(service):
    assert health_pb2.HealthCheckRequest.FromString(health.encode_request(service)).service == service
    assert health.decode_request(health_pb2.HealthCheckRequest(service=service).SerializeToString()) == service


@pytest.mark.parametrize("status", [0, 1, 2, 3])
def test_response_codec_matches_generated_messages(status):
    assert health_pb2.HealthCheckResponse.FromString(health.encode_response(status)).status == status
    assert health.decode_response(health_pb2.HealthCheckResponse(status=status).SerializeToString()) == status


def test_request_decoder_skips_unknown_fields_and_refuses_garbage():
    assert health.decode_request(b"\x10\x05\x19" + bytes(8) + b"\x0a\x01s\x25" + bytes(4)) == "s"
    for raw in GARBAGE:
        with pytest.raises(ValueError):
            health.decode_request(raw)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _code(call) -> str:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"
    return "OK"


def test_fallback_server_answers_standard_and_own_clients():
    async def main():
        port = _port()
        server = grpc.aio.server()
        hs = health.HealthFallback()
        server.add_generic_rpc_handlers((hs.handler(),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await hs.set("svc", health.SERVING)
        await hs.set("down", health.NOT_SERVING)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                std = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="svc"))
                own = await health.check_callable(ch)("down", timeout=5)
                unknown = await _code(health.check_callable(ch)("nope", timeout=5))
                garbage = [await _code(ch.unary_unary(health.CHECK_METHOD, **RAW)(raw, timeout=5)) for raw in GARBAGE]
            return std.status, own, unknown, garbage
        finally:
            await server.stop(0)

    std, own, unknown, garbage = asyncio.run(main())
    assert (std, own) == (health_pb2.HealthCheckResponse.SERVING, health.NOT_SERVING)
    assert unknown == "NOT_FOUND: service 'nope': unknown"
    assert all(g.startswith("INVALID_ARGUMENT: grpc.health.v1.Health.Check: grpc.health.v1.HealthCheckRequest: not a "
                            "valid message") for g in garbage), garbage


def test_health_and_reflection_refuse_garbage_and_still_answer():
    """They were registered with gRPC's own deserializer: bad bytes ended the call UNKNOWN ("Unexpected DecodeError")
    with a traceback in the log for each, and an unknown service was NOT_FOUND without a word."""
    reflect = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"

    async def main():
        port = _port()
        server = new_server()
        hs = add_health_and_reflection(server, ["tandem.v1.Test"])
        add_port(server, f"127.0.0.1:{port}")
        await server.start()
        await set_serving(hs, ["tandem.v1.Test"], True)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                check = (await stub.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Test"))).status
                unknown = await _code(stub.Check(health_pb2.HealthCheckRequest(service="nope")))
                garbage = [await _code(ch.unary_unary(health.CHECK_METHOD, **RAW)(raw, timeout=5)) for raw in GARBAGE]
                watch = stub.Watch(health_pb2.HealthCheckRequest(service="tandem.v1.Test"))
                watched = (await watch.read()).status
                watch.cancel()

                async def one(raw):
                    yield raw

                listed = reflection_pb2.ServerReflectionResponse.FromString(await ch.stream_stream(reflect, **RAW)(
                    one(reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString())).read())
                bad_reflection = await _code(ch.stream_stream(reflect, **RAW)(one(GARBAGE[0])).read())
            return check, unknown, garbage, watched, listed, bad_reflection
        finally:
            await server.stop(0)

    check, unknown, garbage, watched, listed, bad_reflection = asyncio.run(main())
    assert check == watched == health_pb2.HealthCheckResponse.SERVING
    assert unknown == "NOT_FOUND: service 'nope': unknown here"
    assert all(g.startswith("INVALID_ARGUMENT: grpc.health.v1.Health.Check: grpc.health.v1.HealthCheckRequest: not a "
                            "valid message (DecodeError") for g in garbage), garbage
    assert "tandem.v1.Test" in [s.name for s in listed.list_services_response.service]
    assert bad_reflection.startswith("INVALID_ARGUMENT: grpc.reflection.v1alpha.ServerReflection.ServerReflectionInfo: "
                                     "grpc.reflection.v1alpha.ServerReflectionRequest: not a valid message"), \
        bad_reflection
