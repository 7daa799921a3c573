"""Keepalive agreement (serving/rpc.py): a channel from `channel` to a server from `new_server`, with the same
interval, keeps an idle stream open through several keepalive pings; a server left at gRPC's ping policy, pinged the
same way, answers GOAWAY too_many_pings and the stream dies (what a decode worker did to the router after an idle
period). gRPC's client pings at most once a second however short the interval, so the test idles ~5 s."""
from __future__ import annotations

import asyncio
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.rpc import add_health_and_reflection, add_port, channel, new_server, set_serving

KEEPALIVE_MS = 1000
IDLE_S = 5.0  # five pings: gRPC's default policy sends GOAWAY at the third within its 5 minutes
DEFAULT_POLICY_WAIT_S = 20.0  # (it fails after ~3 s; the bound only keeps a broken test from hanging)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve(server: grpc.aio.Server):
    address = f"127.0.0.1:{_port()}"
    hs = add_health_and_reflection(server, ["tandem.v1.Test"])
    add_port(server, address)
    await server.start()
    await set_serving(hs, ["tandem.v1.Test"], True)
    return address, hs


async def _idle_stream(address: str, hs, idle_s: float):
    """A Watch stream on `channel`, left without data for idle_s: how it ended, or, when it is still open, the
    channel's state, the status change the stream then delivers, and a Check on the same channel."""
    async with channel(address, keepalive_ms=KEEPALIVE_MS) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="tandem.v1.Test"))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        pending = asyncio.ensure_future(watch.read())  # (not wait_for: its timeout would cancel the call)
        done, _ = await asyncio.wait({pending}, timeout=idle_s)
        if done:
            try:
                return "unexpected update", pending.result()
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
        state = ch.get_state()
        await set_serving(hs, ["tandem.v1.Test"], False)
        update = (await asyncio.wait_for(pending, 5)).status
        check = (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
        return state, update, check


def test_an_idle_stream_survives_the_keepalive_pings_of_its_own_channel():
    async def main():
        ours, defaults = new_server(keepalive_ms=KEEPALIVE_MS), grpc.aio.server()
        try:
            (ours_at, ours_hs), (defaults_at, defaults_hs) = await _serve(ours), await _serve(defaults)
            return await asyncio.gather(_idle_stream(ours_at, ours_hs, IDLE_S),
                                        _idle_stream(defaults_at, defaults_hs, DEFAULT_POLICY_WAIT_S))
        finally:
            await ours.stop(0)
            await defaults.stop(0)

    ours, defaults = asyncio.run(main())
    # Five pings later the stream is open, the connection the same, and both still deliver.
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    assert ours == (grpc.ChannelConnectivity.READY, not_serving, not_serving), ours
    assert defaults == (grpc.StatusCode.UNAVAILABLE, "Too many pings"), defaults
