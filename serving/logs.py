"""How every Tandem process logs: `--log-level`, `--log-format text|json`, and the request id on every line about a
request.

The request id lives in a contextvar (`request_scope`), set where a request enters a process: the router's HTTP and
gRPC fronts and its core, the prefill and decode servicers. asyncio copies the contextvars into every task it
starts, so the lines logged by the tasks that serve the request (a migration, a KV transfer, a timer that expires
its reservation) carry the id too; a line logged elsewhere (the engine thread) can pass `extra={"request_id": ...}`.

json: one object per line on stderr, `{"ts", "level", "logger", "message", "role", "request_id"?, "exc"?}`; the
libraries' own loggers (uvicorn, transformers, the OTLP exporter, Python warnings) go through the same handler, so
that every line a process writes parses. text: `ts LEVEL logger: [request_id] message`, as before.
"""
from __future__ import annotations

import argparse
import contextlib
import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from datetime import datetime, timezone

FORMATS = ("text", "json")
DEFAULT_FORMAT = "text"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(request_tag)s%(message)s"

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("tandem_request_id", default=None)


def add_log_args(p: argparse.ArgumentParser, level_default: str = "INFO") -> None:
    """--log-format (every role and `tandem up`); --log-level stays where each role declares it."""
    p.add_argument("--log-format", choices=FORMATS, default=DEFAULT_FORMAT,
                   help="text: one readable line per record; json: one JSON object per line (ts, level, logger, "
                        f"message, role, request_id, exc) for log collectors (default: {DEFAULT_FORMAT})")


def log_flags(ns: argparse.Namespace) -> list[str]:
    """The flag to pass on to a child process (`tandem up`), where it is not the default."""
    fmt = getattr(ns, "log_format", DEFAULT_FORMAT)
    return [] if fmt == DEFAULT_FORMAT else ["--log-format", fmt]


@contextlib.contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Lines logged inside the block (and by the tasks it starts) carry request_id. Safe in an async generator: its
    end may run in another task's context, where there is nothing to reset."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        try:
            _request_id.reset(token)
        except ValueError:  # (left in another context than it was entered in)
            pass


def tag_request(request_id: str) -> None:
    """Lines logged by the rest of this task (and the tasks it starts from now on) carry request_id: for a task
    that serves one request and ends with it (a gRPC call's, an HTTP request's), where a `with` would end before
    a streamed response does."""
    _request_id.set(request_id)


def current_request_id() -> str | None:
    return _request_id.get()


class RequestIdFilter(logging.Filter):
    """Adds `request_id` (the record's own `extra`, else the contextvar's) and `role` to every record."""

    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = _request_id.get()
        record.request_tag = f"[{record.request_id}] " if record.request_id else ""
        record.role = self.role
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage(),
               "role": getattr(record, "role", None)}
        if getattr(record, "request_id", None):
            out["request_id"] = record.request_id
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def json_line(role: str, message: str, level: str = "INFO", logger: str = "tandem") -> str:
    """One line as the json format writes it, for output that does not go through logging (`tandem up`'s)."""
    record = logging.LogRecord(logger, logging.getLevelName(level), "", 0, message, None, None)
    record.role, record.request_id = role, None
    return JsonFormatter().format(record)


def configure(role: str, level: str = "INFO", fmt: str = DEFAULT_FORMAT) -> None:
    """The root logger of this process: one stderr handler in `fmt` with the request-id filter, at `level`."""
    if fmt not in FORMATS:
        raise ValueError(f"log_format={fmt!r}: must be one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter(role))
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    if fmt == "json":
        _route_libraries_through_root()


def _route_libraries_through_root() -> None:
    """The libraries that print by themselves, made to log through the root handler instead."""
    logging.captureWarnings(True)

    def excepthook(kind, value, tb):  # a crash's traceback as one record, not raw lines
        logging.getLogger("tandem").critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb))
    sys.excepthook = excepthook
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lib = logging.getLogger(name)
        lib.handlers.clear()
        lib.propagate = True
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - the engine needs transformers
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()
