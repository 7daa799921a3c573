"""Errors -> gRPC status codes, in one place: every servicer method is wrapped by `grpc_method`, which turns a
`ServiceError`, a `ValueError` (bad input: the message names the field), a router `RequestError` or anything else into
`context.abort(code, message)`.
"""
from __future__ import annotations

import functools
import inspect
import logging

import grpc

log = logging.getLogger("tandem.rpc")


class ServiceError(Exception):
    """An error that ends one RPC with a status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# RequestError.code (router/core.py, shared with the HTTP front) -> gRPC status.
_CODE_NAMES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "deadline_exceeded": grpc.StatusCode.DEADLINE_EXCEEDED,
    "cancelled": grpc.StatusCode.CANCELLED,
    "internal": grpc.StatusCode.INTERNAL,
}


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message that end an RPC which raised exc."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code in _CODE_NAMES:  # router.core.RequestError
        return _CODE_NAMES[code], str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):  # an upstream call failed: pass its status on
        return exc.code(), exc.details() or exc.code().name
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def grpc_method(fn):
    """Wraps an async servicer method (unary or server-streaming): errors end the RPC via `status_of`."""
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream(self, request, context):
            try:
                async for item in fn(self, request, context):
                    yield item
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - the one place errors become status codes
                code, msg = status_of(exc)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("%s failed", fn.__qualname__)
                await context.abort(code, msg)
        return stream

    @functools.wraps(fn)
    async def unary(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            code, msg = status_of(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", fn.__qualname__)
            await context.abort(code, msg)
    return unary
