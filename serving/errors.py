"""Errors -> gRPC status codes, in one place: every servicer method is wrapped by `grpc_method`, which turns a
`ServiceError`, a `ValueError` (bad input: the message names the field), a router `RequestError` or anything else into
`context.abort(code, message)`, the message cut to MAX_MESSAGE_WIRE_BYTES (with trailing metadata `retry-after`, in
seconds, for a refusal under load that says when to try again). `shown(value)` is how a message or a log line
quotes what a caller sent.
"""
from __future__ import annotations

import functools
import inspect
import logging
import time

import grpc

log = logging.getLogger("tandem.rpc")

# A status message travels in a trailer, percent-encoded (3 bytes for each byte of UTF-8 outside printable ASCII):
# gRPC clients refuse metadata past 8 KiB (some of the time) and past 16 KiB (always) with RESOURCE_EXHAUSTED
# ("received metadata size exceeds ... limit") instead of the status, and take down the whole connection, every
# other call on it included. A message that quotes a caller's megabyte-long field is cut to this size on the wire.
MAX_MESSAGE_WIRE_BYTES = 4096
_SHOWN_CHARS = 80


def shown(value, limit: int = _SHOWN_CHARS) -> str:
    """repr(value) for a message or a log line, cut to about `limit` characters (a caller's string may be megabytes
    long and hold newlines: repr escapes them)."""
    r = repr(value)
    if len(r) <= limit:
        return r
    size = f" ({len(value)} {'bytes' if isinstance(value, bytes) else 'characters'})" \
        if isinstance(value, (str, bytes)) else ""
    return f"{r[:limit]}...{size}"


def _wire_bytes(ch: str) -> int:
    return 1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8", "surrogatepass"))


def clipped(message: str, limit: int = MAX_MESSAGE_WIRE_BYTES) -> str:
    """message, cut (saying how long it was) where its percent-encoding would pass `limit` bytes."""
    size = 0
    for i, ch in enumerate(message):
        size += _wire_bytes(ch)
        if size > limit - 60:  # (room for the note)
            return f"{message[:i]}... (message cut; {len(message)} characters)"
    return message


class ServiceError(Exception):
    """An error that ends one RPC with a status code."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# RequestError.code (router/backend.py, shared with the HTTP front) -> gRPC status.
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


class _FailureLog:
    """Logs unexpected failures (INTERNAL) with their traceback, at most once per `interval_s` for each method and
    exception type; the ones in between are counted and the count goes with the next line. A peer that sends
    garbage in a loop then writes a line every few seconds, not a traceback per call."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._last: dict[tuple[str, type], tuple[float, int]] = {}  # -> (time logged, failures since)

    def __call__(self, where: str, exc: BaseException) -> None:
        key, now = (where, type(exc)), time.monotonic()
        logged, since = self._last.get(key, (None, 0))
        if logged is not None and now - logged < self.interval_s:
            self._last[key] = (logged, since + 1)
            return
        self._last[key] = (now, 0)
        more = f" (and {since} more time(s) in the last {now - logged:.0f} s)" if since else ""
        log.error("%s failed%s", where, more, exc_info=exc)


log_failure = _FailureLog()


async def _abort(context, where: str, exc: Exception) -> None:
    code, msg = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log_failure(where, exc)
    retry = getattr(exc, "retry_after_s", None)  # a router refusal under load: when to try again, in seconds
    await context.abort(code, clipped(msg),
                        trailing_metadata=(("retry-after", str(retry)),) if retry is not None else ())


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
                await _abort(context, fn.__qualname__, exc)
        return stream

    @functools.wraps(fn)
    async def unary(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, fn.__qualname__, exc)
    return unary
