"""The gRPC plumbing every Tandem process shares: message-size limits and keepalive, servers and channels, health
and reflection.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

import grpc

from serving import health as health_codec

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
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


def new_server() -> grpc.aio.Server:
    return grpc.aio.server(options=GRPC_OPTIONS)


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


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
