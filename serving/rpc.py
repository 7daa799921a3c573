"""The gRPC plumbing every Tandem process shares: message-size limits and keepalive, servers and channels, health
and reflection.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from serving import health as health_codec
from serving.tls import TlsConfig

try:  # optional: the GPU image has grpcio only (see serving/health.py)
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
except ImportError:  # pragma: no cover - depends on the machine
    health = None
try:
    from grpc_reflection.v1alpha import reflection
except ImportError:  # pragma: no cover
    reflection = None

log = logging.getLogger("tandem.rpc")

# A KV transfer message carries a few MiB of payload but at least one block (kv_transfer/sender.py); the limits
# leave room for very large blocks and for the public API's long prompts. The HTTP/2 settings stay gRPC's defaults:
# on loopback, a larger max frame size, initial window (lookahead_bytes, BDP probing off) or TCP read chunk made no
# difference to the KV bytes path (measured with bench/kv_transfer.py on loopback).
MAX_MESSAGE_BYTES = 512 * 1024 * 1024
# Keepalive: every channel pings an idle connection at this interval (so a dead peer is noticed and NATs keep the
# connection), and every server accepts pings that often, with or without calls in flight. gRPC's server default
# refuses pings without data more often than every 5 minutes: two such pings, and it answers GOAWAY too_many_pings
# and drops the connection (what a decode worker once did to the router after an idle period).
KEEPALIVE_TIME_MS = 30_000
# Reconnecting to a peer that went away: gRPC's default backoff starts at 1 s and grows 1.6x a try up to 120 s, so
# a worker restarted after a few failed tries was not dialled again for seconds after its port answered (a router
# once sent it nothing for 5 s). Capped at half the router's health-poll interval, a restarted instance is
# connected before the second poll after it answers, and takes traffic then. A refused dial costs one SYN.
MAX_RECONNECT_BACKOFF_MS = 500
_SIZES = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
GRPC_OPTIONS = [  # a channel's
    *_SIZES,
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]
SERVER_OPTIONS = [
    *_SIZES,
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_pings_without_data", 0),
]


def new_server(interceptors: Iterable[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=list(interceptors))


def add_port(server: grpc.aio.Server, address: str, tls: TlsConfig | None = None,
             require_client_auth: bool = True) -> int:
    """Listens on address ("host:port"): plaintext without `tls`; with it TLS, and mutual TLS unless
    require_client_auth is False (the router's public API). Returns the port; OSError when it cannot bind."""
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, tls.server_credentials(require_client_auth))
    if port == 0:
        raise OSError(f"cannot bind a gRPC server to {address}")
    return port


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str]):
    """Registers grpc.health.v1 (set each service and "" with `set_serving`) and server reflection. Without
    grpcio-health-checking a Check-only fallback serves health; without grpcio-reflection there is no reflection."""
    names = list(service_names)
    if health is not None:
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    else:
        hs = health_codec.HealthFallback()
        server.add_generic_rpc_handlers((hs.handler(),))
        log.warning("grpcio-health-checking is not installed: serving grpc.health.v1 Check only (no Watch)")
    if reflection is not None:
        reflection.enable_server_reflection(names + [health_codec.SERVICE, reflection.SERVICE_NAME], server)
    else:
        log.warning("grpcio-reflection is not installed: no server reflection")
    return hs


async def set_serving(hs, service_names: Iterable[str], serving: bool) -> None:
    status = health_codec.SERVING if serving else health_codec.NOT_SERVING
    if health is not None and not isinstance(hs, health_codec.HealthFallback):
        status = health_pb2.HealthCheckResponse.ServingStatus.Value("SERVING" if serving else "NOT_SERVING")
    for name in ["", *service_names]:
        await hs.set(name, status)


def channel(address: str, tls: TlsConfig | None = None) -> grpc.aio.Channel:
    """A channel to another Tandem process: plaintext, or mutual TLS with `tls` (this process's certificate, the
    peer's checked against the CA and the address)."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=GRPC_OPTIONS)


def _parsed(parse, raw: bytes, what: str):
    try:
        return parse(raw)
    except (DecodeError, ValueError) as e:
        raise ValueError(f"{what}: not a valid message ({type(e).__name__}: {e})") from None


def add_service(server: grpc.aio.Server, service: ServiceDescriptor, servicer,
                parsers: dict[str, Callable[[bytes], Any]] | None = None) -> None:
    """Serves every method of `service` (a protobuf ServiceDescriptor) from `servicer`'s method of the same name.

    Requests reach the method parsed, but they are parsed inside the call, not by gRPC: bytes that are no valid
    message end that call with INVALID_ARGUMENT naming the message (gRPC's own deserializer would answer INTERNAL,
    "Exception deserializing request!", and log a traceback for each). `parsers` replaces a method's parser (the
    decode service's TransferKv reads KV payloads without copying them)."""
    handlers = {}
    for m in service.methods:
        request, response = GetMessageClass(m.input_type), GetMessageClass(m.output_type)
        parse = (parsers or {}).get(m.name, request.FromString)
        fn, what = getattr(servicer, m.name), f"{m.full_name}: {m.input_type.full_name}"
        handlers[m.name] = _handler(m.client_streaming, m.server_streaming, fn, parse, what,
                                    response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _handler(client_streaming: bool, server_streaming: bool, fn, parse, what: str, serialize):
    if client_streaming:
        async def requests(raw_iterator):
            async for raw in raw_iterator:
                yield _parsed(parse, raw, what)

        if server_streaming:
            async def stream_stream(raw_iterator, context):
                async for item in fn(requests(raw_iterator), context):
                    yield item
            return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=serialize)

        async def stream_unary(raw_iterator, context):
            return await fn(requests(raw_iterator), context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=serialize)

    async def parsed_or_abort(raw: bytes, context):
        try:
            return _parsed(parse, raw, what)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    if server_streaming:
        async def unary_stream(raw, context):
            request = await parsed_or_abort(raw, context)
            async for item in fn(request, context):
                yield item
        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=serialize)

    async def unary_unary(raw, context):
        return await fn(await parsed_or_abort(raw, context), context)
    return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=serialize)
