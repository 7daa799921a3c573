"""serving/health.py: the hand-encoded grpc.health.v1 Check agrees with the generated messages, and the fallback
server (used where grpcio-health-checking is missing) answers both the standard stub and our client."""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving import health


@pytest.mark.parametrize("service", ["", "tandem.v1.Prefill", "x" * 300])
def test_request_codec_matches_generated_messages(service):
    assert health_pb2.HealthCheckRequest.FromString(health.encode_request(service)).service == service
    assert health.decode_request(health_pb2.HealthCheckRequest(service=service).SerializeToString()) == service


@pytest.mark.parametrize("status", [0, 1, 2, 3])
def test_response_codec_matches_generated_messages(status):
    assert health_pb2.HealthCheckResponse.FromString(health.encode_response(status)).status == status
    assert health.decode_response(health_pb2.HealthCheckResponse(status=status).SerializeToString()) == status


def test_fallback_server_answers_standard_and_own_clients():
    async def main():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
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
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await health.check_callable(ch)("nope", timeout=5)
            return std.status, own, ei.value.code()
        finally:
            await server.stop(0)

    assert asyncio.run(main()) == (health_pb2.HealthCheckResponse.SERVING, health.NOT_SERVING,
                                   grpc.StatusCode.NOT_FOUND)
