"""serving.rpc.add_service: malformed request bytes end the call with INVALID_ARGUMENT naming the message, on every
kind of method (unary, server-streaming, client-streaming), instead of gRPC's INTERNAL; valid ones reach the
servicer parsed; with a RequestLimit, a larger message is RESOURCE_EXHAUSTED naming the limit and its flag.
serving.errors' failure log writes one traceback per interval, with a count, not one per call, and cuts status
messages that quote huge values."""
from __future__ import annotations

import asyncio
import logging
import socket

import grpc
import pytest

from protos.tandem.v1 import common_pb2, decode_pb2, kv_transfer_pb2 as kv
from serving import errors
from serving.errors import grpc_method
from serving.rpc import RequestLimit, add_port, add_service, channel, new_server

DECODE = decode_pb2.DESCRIPTOR.services_by_name["Decode"]
TRUNCATED = b"\x0a\x05ab"  # field 1, length 5, two bytes: no protobuf parser accepts it


class Echo:
    """A Decode servicer that answers from what it was sent (and fails on request)."""

    @grpc_method
    async def Decode(self, request, context):
        for _ in range(2):
            yield decode_pb2.DecodeResponse(reserved=decode_pb2.Reserved(num_blocks=len(request.prompt_token_ids)))

    @grpc_method
    async def TransferKv(self, messages, context):
        n = 0
        async for msg in messages:
            n += msg.blocks.num_blocks
        return kv.KvTransferAck(request_id="echo", num_blocks=n)

    @grpc_method
    async def KvHandshake(self, request, context):
        if request.host.pid:  # a refusal that quotes the whole of a huge field
            raise ValueError(f"host.hostname={request.host.hostname!r}: unknown")
        return kv.KvHandshakeResponse(reason=request.host.hostname)

    @grpc_method
    async def GetLoad(self, request, context):
        raise RuntimeError("boom")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _path(method: str) -> str:
    return f"/{DECODE.full_name}/{method}"


def run(scenario, limit: RequestLimit | None = None):
    async def main():
        address = f"127.0.0.1:{_free_port()}"
        server = new_server(limit=limit)
        add_service(server, DECODE, Echo(), limit=limit)
        add_port(server, address)
        await server.start()
        try:
            async with channel(address) as ch:
                return await scenario(ch)
        finally:
            await server.stop(0)
    return asyncio.run(main())


async def _code(call) -> grpc.StatusCode | str:
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"
    return "OK"


def test_valid_requests_reach_the_servicer_parsed():
    async def scenario(ch):
        stub_unary = ch.unary_unary(_path("KvHandshake"), request_serializer=kv.KvHandshakeRequest.SerializeToString,
                                    response_deserializer=kv.KvHandshakeResponse.FromString)
        stream = ch.unary_stream(_path("Decode"), request_serializer=decode_pb2.DecodeRequest.SerializeToString,
                                 response_deserializer=decode_pb2.DecodeResponse.FromString)
        upload = ch.stream_unary(_path("TransferKv"), request_serializer=kv.KvTransferMessage.SerializeToString,
                                 response_deserializer=kv.KvTransferAck.FromString)

        async def blocks():
            for n in (2, 3):
                yield kv.KvTransferMessage(blocks=kv.KvBlocks(num_blocks=n))

        hs = await stub_unary(kv.KvHandshakeRequest(host=kv.HostIdentity(hostname="h1")))
        deltas = [r async for r in stream(decode_pb2.DecodeRequest(prompt_token_ids=[1, 2, 3]))]
        ack = await upload(blocks())
        return hs.reason, [d.reserved.num_blocks for d in deltas], ack.num_blocks

    assert run(scenario) == ("h1", [3, 3], 5)


def test_malformed_bytes_are_invalid_argument_on_every_kind_of_method():
    raw = dict(request_serializer=lambda b: b, response_deserializer=lambda b: b)

    async def scenario(ch):
        async def one_good_then_garbage():
            yield kv.KvTransferMessage(blocks=kv.KvBlocks(num_blocks=1)).SerializeToString()
            yield TRUNCATED

        async def read_all(call):
            return [r async for r in call]

        return {
            "unary": await _code(ch.unary_unary(_path("KvHandshake"), **raw)(TRUNCATED)),
            "server-streaming": await _code(read_all(ch.unary_stream(_path("Decode"), **raw)(TRUNCATED))),
            "client-streaming": await _code(ch.stream_unary(_path("TransferKv"), **raw)(one_good_then_garbage())),
        }

    got = run(scenario)
    # (protobuf's own words after "DecodeError" differ between its versions)
    prefix = "INVALID_ARGUMENT: tandem.v1.Decode.{}: tandem.v1.{}: not a valid message (DecodeError: "
    assert got["unary"].startswith(prefix.format("KvHandshake", "KvHandshakeRequest")), got
    assert got["server-streaming"].startswith(prefix.format("Decode", "DecodeRequest")), got
    assert got["client-streaming"].startswith(prefix.format("TransferKv", "KvTransferMessage")), got


def test_repeated_failures_log_one_traceback_per_interval(caplog, monkeypatch):
    monkeypatch.setattr(errors, "log_failure", errors._FailureLog(interval_s=3600))
    call_count = 30

    async def scenario(ch):
        get_load = ch.unary_unary(_path("GetLoad"), request_serializer=common_pb2.GetLoadRequest.SerializeToString,
                                  response_deserializer=common_pb2.InstanceLoad.FromString)
        return [await _code(get_load(common_pb2.GetLoadRequest())) for _ in range(call_count)]

    with caplog.at_level(logging.ERROR, logger="tandem.rpc"):
        codes = run(scenario)
    assert codes == ["INTERNAL: RuntimeError: boom"] * call_count
    records = [r for r in caplog.records if r.name == "tandem.rpc"]
    assert len(records) == 1 and records[0].exc_info is not None, [r.getMessage() for r in records]


def test_the_failure_log_counts_what_it_held_back(caplog):
    clock = [0.0]
    log = errors._FailureLog(interval_s=10)
    monkey_time = pytest.MonkeyPatch()
    monkey_time.setattr(errors.time, "monotonic", lambda: clock[0])
    try:
        with caplog.at_level(logging.ERROR, logger="tandem.rpc"):
            for t in (0, 1, 2, 3, 11, 12):
                clock[0] = t
                log("Svc.M", RuntimeError("x"))
            log("Svc.M", ValueError("another type is its own line"))
    finally:
        monkey_time.undo()
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["Svc.M failed", "Svc.M failed (and 3 more time(s) in the last 11 s)", "Svc.M failed"], messages


@pytest.mark.parametrize("char", ["x", "\U0001F600"])
def test_a_refusal_quoting_a_huge_value_is_cut_and_the_connection_lives(char):
    """A status message travels in a trailer: past 8-16 KiB percent-encoded the client answered RESOURCE_EXHAUSTED
    ("received metadata size exceeds ... limit") instead of the refusal, and dropped the connection with every call
    on it."""
    async def scenario(ch):
        handshake = ch.unary_unary(_path("KvHandshake"), request_serializer=kv.KvHandshakeRequest.SerializeToString,
                                   response_deserializer=kv.KvHandshakeResponse.FromString)
        huge = await _code(handshake(kv.KvHandshakeRequest(host=kv.HostIdentity(hostname=char * 100_000, pid=1))))
        after = await handshake(kv.KvHandshakeRequest(host=kv.HostIdentity(hostname="h2")))
        return huge, after.reason

    huge, after = run(scenario)
    assert huge.startswith(f"INVALID_ARGUMENT: host.hostname='{char * 3}") and huge.endswith(
        "... (message cut; 100025 characters)"), huge[-100:]
    encoded = len(huge.encode()) + 2 * sum(1 for c in huge.encode() if c > 0x7E)
    assert encoded <= errors.MAX_MESSAGE_WIRE_BYTES and after == "h2"


def test_a_message_over_the_limit_is_resource_exhausted_naming_the_flag():
    limit = RequestLimit(1000, "--max-test-bytes")

    async def scenario(ch):
        handshake = ch.unary_unary(_path("KvHandshake"), request_serializer=kv.KvHandshakeRequest.SerializeToString,
                                   response_deserializer=kv.KvHandshakeResponse.FromString)
        upload = ch.stream_unary(_path("TransferKv"), request_serializer=kv.KvTransferMessage.SerializeToString,
                                 response_deserializer=kv.KvTransferAck.FromString)

        async def blocks(size):
            yield kv.KvTransferMessage(blocks=kv.KvBlocks(num_blocks=1, data=bytes(size)))

        def host(n):
            return kv.KvHandshakeRequest(host=kv.HostIdentity(hostname="h" * n))
        return {"fits": (await handshake(host(990))).reason == "h" * 990,
                "unary": await _code(handshake(host(1200))),
                "past gRPC's own limit": await _code(handshake(host(2000))),
                "streamed": await _code(upload(blocks(1200))),
                "streamed, fits": (await upload(blocks(900))).num_blocks}

    got = run(scenario, limit)
    assert got["fits"] and got["streamed, fits"] == 1
    assert got["unary"] == ("RESOURCE_EXHAUSTED: tandem.v1.Decode.KvHandshake: tandem.v1.KvHandshakeRequest: "
                            "request message: 1206 bytes, more than the 1000 this server takes (--max-test-bytes)")
    assert got["streamed"].startswith("RESOURCE_EXHAUSTED: tandem.v1.Decode.TransferKv: tandem.v1.KvTransferMessage: "
                                      "request message: 1208 bytes, more than the 1000"), got
    # Past core_bytes (1.5 x the limit) gRPC core refuses the message itself, naming both sizes.
    assert got["past gRPC's own limit"].startswith("RESOURCE_EXHAUSTED: ") and "(2006 vs. 1500)" in got[
        "past gRPC's own limit"], got
