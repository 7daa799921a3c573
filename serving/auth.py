"""API-key authentication of the router's public APIs (vLLM's `--api-key`): `Authorization: Bearer <key>` on HTTP,
the same as `authorization` metadata on gRPC.

- HTTP (`ApiKeyMiddleware`, ASGI): a request without the right key is answered 401 in OpenAI's error shape
  (`code: invalid_api_key`, with `WWW-Authenticate: Bearer`) before its body is read; the open paths (by default
  `/health`, `/livez`, `/ping` and `/metrics`, for probes and scrapers) need none.
- gRPC (`ApiKeyInterceptor`): a call to a protected service without the right key ends with UNAUTHENTICATED before
  its request is read; grpc.health.v1 and reflection stay open.

Keys are compared in constant time. The key comes from `--api-key` or TANDEM_API_KEY (the environment keeps it out
of process listings and of `tandem up`'s printed command lines).
"""
from __future__ import annotations

import argparse
import hmac
import json
import os
from collections.abc import Iterable

import grpc

ENV_API_KEY = "TANDEM_API_KEY"
DEFAULT_OPEN_PATHS = ("/health", "/livez", "/ping", "/metrics")


def add_api_key_args(p: argparse.ArgumentParser, open_paths: bool = True) -> None:
    """The router's --api-key (and --api-key-open-paths), declared once for `tandem router` and `tandem up`."""
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on the router's HTTP API and 'authorization' metadata "
                        f"on its gRPC API (default: ${ENV_API_KEY}, else no key; tandem up hands it to the router in "
                        "its environment, never on a command line)")
    if open_paths:
        p.add_argument("--api-key-open-paths", default=",".join(DEFAULT_OPEN_PATHS),
                       help="HTTP paths served without the key, comma-separated ('' protects every path; default: "
                            f"{','.join(DEFAULT_OPEN_PATHS)})")


class ApiKey:
    def __init__(self, key: str):
        if not key:
            raise ValueError("api_key: must not be empty")
        self._expected = f"Bearer {key}".encode()

    def matches(self, authorization: str | bytes | None) -> bool:
        """Whether an Authorization header (or gRPC metadata) value carries the key."""
        if authorization is None:
            return False
        given = authorization.encode() if isinstance(authorization, str) else authorization
        return hmac.compare_digest(given, self._expected)

    @classmethod
    def from_flag(cls, value: str | None) -> ApiKey | None:
        """The key of `--api-key`, else of $TANDEM_API_KEY; None when neither is set (no authentication)."""
        key = value if value is not None else os.environ.get(ENV_API_KEY)
        return cls(key) if key else None


_UNAUTHORIZED = json.dumps({"error": {
    "message": "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()


class ApiKeyMiddleware:
    """ASGI middleware: 401 for HTTP requests without the key, except on `open_paths`."""

    def __init__(self, app, api_key: ApiKey, open_paths: Iterable[str] = DEFAULT_OPEN_PATHS):
        self.app, self.api_key, self.open_paths = app, api_key, frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), None)
        if self.api_key.matches(header):
            return await self.app(scope, receive, send)
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(_UNAUTHORIZED)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls to `services` (full names) without the key in `authorization` metadata."""

    def __init__(self, api_key: ApiKey, services: Iterable[str]):
        self.api_key = api_key
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefixes):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self.api_key.matches(metadata.get("authorization")):
            return handler
        return _refusal(handler)


_REFUSED = "missing or wrong API key: send the metadata 'authorization: Bearer <key>'"


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with UNAUTHENTICATED."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)
        yield  # (an async generator, as a streaming response's handler is)

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(streaming if handler.response_streaming else unary,
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
