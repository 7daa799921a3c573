"""The gRPC plumbing every Tandem process shares: message-size limits and keepalive, servers and channels, health
and reflection.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from serving import health as health_codec
from serving.errors import ServiceError, clipped, shown
from serving.tls import TlsConfig

try:  # optional: the GPU image has grpcio only (see serving/health.py)
    from grpc_health.v1 import health, health_pb2
except ImportError:  # pragma: no cover - depends on the machine
    health = None
try:
    from serving import reflection
except ImportError:  # pragma: no cover - grpcio-reflection missing
    reflection = None

log = logging.getLogger("tandem.rpc")

# A KV transfer message carries a few MiB of payload but at least one block (kv_transfer/sender.py); the limit leaves
# room for very large blocks. The public API takes less (router --max-grpc-message-bytes: `RequestLimit`). The
# HTTP/2 settings stay gRPC's defaults: on loopback, a larger max frame size, initial window (lookahead_bytes, BDP
# probing off) or TCP read chunk made no difference to the KV bytes path (measured with bench/kv_transfer.py on
# loopback).
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
# Reconnecting to a peer that went away: gRPC's default backoff starts at 1 s and grows 1.6x a try up to 120 s, so
# a worker restarted after a few failed tries was not dialled again for seconds after its port answered (a router
# once sent it nothing for 5 s). Capped at half the router's health-poll interval, a restarted instance is
# connected before the second poll after it answers, and takes traffic then. A refused dial costs one SYN.
MAX_RECONNECT_BACKOFF_MS = 500


def channel_options(keepalive_ms: int = KEEPALIVE_TIME_MS) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]


def server_options(keepalive_ms: int = KEEPALIVE_TIME_MS,
                   max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """A server's options: it accepts the pings of channels built with the same keepalive_ms (half that interval
    apart, with or without calls), and messages of up to max_receive_bytes."""
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", max_receive_bytes),
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            # (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS)
            ("grpc.http2.min_ping_interval_without_data_ms", keepalive_ms // 2),
            ("grpc.http2.max_pings_without_data", 0)]


GRPC_OPTIONS = channel_options()  # a channel's
SERVER_OPTIONS = server_options()


@dataclass(frozen=True)
class RequestLimit:
    """The largest request message a server takes (the public API's: less than the workers' MAX_MESSAGE_BYTES). A
    larger one ends its call with RESOURCE_EXHAUSTED naming the size, the limit and `flag` (checked on the raw bytes
    in `add_service`, before parsing); gRPC core itself refuses messages past `core_bytes`, so that memory stays
    bounded, with its own RESOURCE_EXHAUSTED ("Received message larger than max (N vs. M)")."""
    max_bytes: int
    flag: str  # the flag that sets max_bytes, e.g. "--max-grpc-message-bytes"

    def __post_init__(self) -> None:
        if not 1 <= self.max_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"{self.flag}={self.max_bytes}: must be in [1, {MAX_MESSAGE_BYTES}]")

    @property
    def core_bytes(self) -> int:
        return min(self.max_bytes + self.max_bytes // 2, 2**31 - 1)

    def refusal(self, size: int) -> str | None:
        if size <= self.max_bytes:
            return None
        return f"request message: {size} bytes, more than the {self.max_bytes} this server takes ({self.flag})"


def new_server(interceptors: Iterable[grpc.aio.ServerInterceptor] = (), limit: RequestLimit | None = None,
               keepalive_ms: int = KEEPALIVE_TIME_MS) -> grpc.aio.Server:
    """A server; with `limit`, pass the same to add_service and add_health_and_reflection."""
    options = server_options(keepalive_ms, MAX_MESSAGE_BYTES if limit is None else limit.core_bytes)
    return grpc.aio.server(options=options, interceptors=list(interceptors))


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


if health is not None:
    class _Health(health.aio.HealthServicer):
        """The package's servicer, whose NOT_FOUND for a service never set says which (its own has no message)."""

        def __init__(self) -> None:
            super().__init__()
            self.known = {""}  # (the package's servicer starts with "" SERVING)

        async def set(self, service: str, status) -> None:
            self.known.add(service)
            await super().set(service, status)

        async def Check(self, request, context):
            if request.service not in self.known:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"service {shown(request.service)}: unknown here")
            return await super().Check(request, context)


def add_health_and_reflection(server: grpc.aio.Server, service_names: Iterable[str],
                              limit: RequestLimit | None = None):
    """Registers grpc.health.v1 (set each service and "" with `set_serving`) and server reflection, both through
    `add_service` (their requests parsed inside the call; `limit`: the server's). Without grpcio-health-checking a
    Check-only fallback serves health; without grpcio-reflection there is no reflection. Reflection answers both
    grpc.reflection.v1 and v1alpha (serving/reflection.py)."""
    names = list(service_names)
    if health is not None:
        hs = _Health()
        add_service(server, health_pb2.DESCRIPTOR.services_by_name["Health"], hs, limit=limit)
    else:
        hs = health_codec.HealthFallback()
        server.add_generic_rpc_handlers((hs.handler(),))
        log.warning("grpcio-health-checking is not installed: serving grpc.health.v1 Check only (no Watch)")
    if reflection is not None:
        for service, servicer in reflection.servicers(names + [health_codec.SERVICE]):
            add_service(server, service, servicer, limit=limit)
    else:
        log.warning("grpcio-reflection is not installed: no server reflection")
    return hs


async def set_serving(hs, service_names: Iterable[str], serving: bool) -> None:
    status = health_codec.SERVING if serving else health_codec.NOT_SERVING
    if health is not None and not isinstance(hs, health_codec.HealthFallback):
        status = health_pb2.HealthCheckResponse.ServingStatus.Value("SERVING" if serving else "NOT_SERVING")
    for name in ["", *service_names]:
        await hs.set(name, status)


def channel(address: str, tls: TlsConfig | None = None, keepalive_ms: int = KEEPALIVE_TIME_MS,
            server_name: str | None = None) -> grpc.aio.Channel:
    """A channel to another Tandem process: plaintext, or mutual TLS with `tls` (this process's certificate, the
    peer's checked against the CA and the address's host, or `server_name` when given: the DNS name an address was
    resolved from, serving/discovery.py). keepalive_ms: as its server's (new_server)."""
    options = channel_options(keepalive_ms)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if server_name is not None:
        options.append(("grpc.ssl_target_name_override", server_name))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


class _BadMessage(ValueError):
    """Request bytes that are no valid message (a ValueError: the servicers' grpc_method makes it INVALID_ARGUMENT)."""


def _parsed(parse, raw: bytes, what: str, limit: RequestLimit | None):
    if limit is not None and (refusal := limit.refusal(len(raw))) is not None:
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{what}: {refusal}")
    try:
        return parse(raw)
    except (DecodeError, ValueError) as e:
        raise _BadMessage(f"{what}: not a valid message ({type(e).__name__}: {e})") from None


def _refusal(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, clipped(exc.message)
    return grpc.StatusCode.INVALID_ARGUMENT, clipped(str(exc))


def add_service(server: grpc.aio.Server, service: ServiceDescriptor, servicer,
                parsers: dict[str, Callable[[bytes], Any]] | None = None, limit: RequestLimit | None = None) -> None:
    """Serves every method of `service` (a protobuf ServiceDescriptor) from `servicer`'s method of the same name.

    Requests reach the method parsed, but they are parsed inside the call, not by gRPC: bytes that are no valid
    message end that call with INVALID_ARGUMENT naming the message (gRPC's own deserializer would answer UNKNOWN or
    INTERNAL, "Exception deserializing request!", and log a traceback for each), and with `limit` a message larger
    than it ends it with RESOURCE_EXHAUSTED naming the limit. The servicer's methods may be Tandem's (wrapped in
    serving.errors.grpc_method) or any other's (health, reflection; a server-streaming one may also answer through
    context.write). `parsers` replaces a method's parser (the decode service's TransferKv reads KV payloads without
    copying them)."""
    handlers = {}
    for m in service.methods:
        request, response = GetMessageClass(m.input_type), GetMessageClass(m.output_type)
        parse = (parsers or {}).get(m.name, request.FromString)
        fn, what = getattr(servicer, m.name), f"{m.full_name}: {m.input_type.full_name}"
        handlers[m.name] = _handler(m.client_streaming, m.server_streaming, fn,
                                    lambda raw, parse=parse, what=what: _parsed(parse, raw, what, limit),
                                    response.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _handler(client_streaming: bool, server_streaming: bool, fn, parse, serialize):
    """parse(raw) raises ServiceError or _BadMessage; a servicer that lets them through (not a grpc_method) has its
    call ended here with their status."""
    if client_streaming:
        async def requests(raw_iterator):
            async for raw in raw_iterator:
                yield parse(raw)

        if server_streaming:
            async def stream_stream(raw_iterator, context):
                try:
                    async for item in fn(requests(raw_iterator), context):
                        yield item
                except (ServiceError, _BadMessage) as e:
                    await context.abort(*_refusal(e))
            return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=serialize)

        async def stream_unary(raw_iterator, context):
            try:
                return await fn(requests(raw_iterator), context)
            except (ServiceError, _BadMessage) as e:
                await context.abort(*_refusal(e))
        return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=serialize)

    async def parsed_or_abort(raw: bytes, context):
        try:
            return parse(raw)
        except (ServiceError, _BadMessage) as e:
            await context.abort(*_refusal(e))

    if server_streaming and inspect.isasyncgenfunction(fn):
        async def unary_stream(raw, context):
            request = await parsed_or_abort(raw, context)
            async for item in fn(request, context):
                yield item
        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=serialize)

    async def unary(raw, context):  # (or server-streaming through context.write, as health's Watch)
        return await fn(await parsed_or_abort(raw, context), context)
    make = grpc.unary_stream_rpc_method_handler if server_streaming else grpc.unary_unary_rpc_method_handler
    return make(unary, response_serializer=serialize)
