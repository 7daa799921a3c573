"""grpc.health.v1 without grpcio-health-checking, for machines that only have grpcio (the GPU image).

The health protocol is two tiny messages (HealthCheckRequest{string service = 1},
HealthCheckResponse{ServingStatus status = 1}), so the client side is encoded by hand here and works with or without
the package; the server side uses the package's servicer when it is installed (Check and Watch) and falls back to
`HealthFallback` (Check only) when it is not.
"""
from __future__ import annotations

import grpc

SERVICE = "grpc.health.v1.Health"
CHECK_METHOD = f"/{SERVICE}/Check"
UNKNOWN, SERVING, NOT_SERVING, SERVICE_UNKNOWN = 0, 1, 2, 3


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    """(value, position after it); ValueError when data ends inside it."""
    shift = value = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def encode_request(service: str) -> bytes:
    raw = service.encode()
    return b"\x0a" + _varint(len(raw)) + raw if raw else b""


def decode_request(data: bytes) -> str:
    """HealthCheckRequest.service; ValueError for bytes that are no HealthCheckRequest (unknown fields are skipped)."""
    i, service = 0, ""
    while i < len(data):
        key, i = _read_varint(data, i)
        wire = key & 7
        if wire == 0:
            _, i = _read_varint(data, i)
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        elif wire == 2:
            n, i = _read_varint(data, i)
            if key >> 3 == 1:
                service = data[i:i + n].decode()  # (UnicodeDecodeError is a ValueError)
            i += n
        else:
            raise ValueError(f"HealthCheckRequest: unexpected wire type {wire}")
        if i > len(data) or key >> 3 == 0:
            raise ValueError("HealthCheckRequest: truncated, or field number 0")
    return service


def encode_response(status: int) -> bytes:
    return b"\x08" + _varint(status) if status else b""


def decode_response(data: bytes) -> int:
    i = 0
    while i < len(data):
        key, i = _read_varint(data, i)
        value, i = _read_varint(data, i) if key & 7 == 0 else (None, i)
        if key == 0x08:
            return value
        if value is None:
            raise ValueError("unexpected wire type in HealthCheckResponse")
    return UNKNOWN


def check_callable(channel: grpc.aio.Channel):
    """An awaitable `check(service, timeout=...) -> status` over channel (no generated code needed)."""
    return channel.unary_unary(CHECK_METHOD, request_serializer=encode_request, response_deserializer=decode_response)


class HealthFallback:
    """Server side of Check when grpcio-health-checking is missing; `set` mirrors the package's aio servicer."""

    def __init__(self):
        self._status: dict[str, int] = {}

    async def set(self, service: str, status: int) -> None:
        self._status[service] = status

    async def _check(self, raw: bytes, context) -> int:
        try:  # parsed here, not by gRPC: bad bytes are INVALID_ARGUMENT (gRPC's deserializer would answer UNKNOWN)
            service = decode_request(raw)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{SERVICE}.Check: grpc.health.v1.HealthCheckRequest: not a valid message ({e})")
        if service not in self._status:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"service {service[:80]!r}: unknown")
        return self._status[service]

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {"Check": grpc.unary_unary_rpc_method_handler(
            self._check, response_serializer=encode_response)})
