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
# refuses pings without data more often than every 5 minutes: after the third such ping it answers GOAWAY
# too_many_pings and drops the connection with its calls (what a decode worker did to the router: a Decode stream
# waits for its KV without data). gRPC ignores option names it does not know, so a misspelt one (this file had
# `min_recv_ping_interval_without_data_ms`) changes nothing, silently. Both sides take the interval from one
# argument; tests/serving/test_keepalive.py idles a stream between them on a short one, and a server left at
# gRPC's defaults next to it for contrast.
KEEPALIVE_TIME_MS = 30_000


def channel_options(keepalive_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]


def server_options(keepalive_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, int]]:
    """A server's options: it accepts the pings of channels built with the same keepalive_ms (half that interval
    apart, with or without calls)."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            # (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS)
            ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2),
            ("grpc.http2.max_pings_without_data", 0)]


GRPC_OPTIONS = channel_options()  # a channel's
SERVER_OPTIONS = server_options()


def new_server(interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
               keepalive_ms: int = KEEPALIVE_TIME_MS) -> grpc.aio.Server:
    return grpc.aio.server(options=server_options(keepalive_ms), interceptors=list(interceptors))


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


def channel(address: str, tls: TlsConfig | None = None, keepalive_ms: int = KEEPALIVE_TIME_MS) -> grpc.aio.Channel:
    """A channel to another Tandem process: plaintext, or mutual TLS with `tls` (this process's certificate, the
    peer's checked against the CA and the address). keepalive_ms: as its server's (new_server)."""
    options = channel_options(keepalive_ms)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


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
