"""OpenTelemetry traces, shared by every role: setup, the W3C trace context on gRPC metadata, span helpers.

Off by default: without `--otlp-traces-endpoint` (vLLM's flag) or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT no tracer
provider is installed, so every span below is OpenTelemetry's no-op one and no metadata is added to any call. With an
endpoint, spans go to an OTLP/gRPC collector through a BatchSpanProcessor: its worker thread exports them, so a slow
or unreachable collector never holds up a request (spans are dropped when its queue is full, the exporter logs it).

The spans of one request, across the processes (service names tandem-router / -prefill / -decode, OTEL_SERVICE_NAME
overrides; the parent of the router's span is the client's `traceparent` header or gRPC metadata, if it sent one):

    llm_request (router, SERVER)             gen_ai.* attributes, queue time, first token, usage
      prefill (prefill, SERVER)              one per attempt: prompt and cached tokens, event first_token
        kv_transfer.send (prefill, CLIENT)   path, blocks, bytes, the decode instance
          kv_transfer.receive (decode, SERVER)
      decode (decode, SERVER)                reservation, event first_token, output tokens, finish reason

The context travels as `traceparent`/`tracestate` gRPC metadata, put on each call at its call site (`metadata()`)
and read by the servicer (`server_span`). Call sites rather than channel interceptors: grpc.aio's interceptors wrap
every call object of the channel (the KV bytes path's too) whether tracing is on or not.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("tandem.tracing")

ENDPOINT_FLAG = "--otlp-traces-endpoint"
ENV_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENV_SERVICE_NAME = "OTEL_SERVICE_NAME"
ENV_SCHEDULE_DELAY = "OTEL_BSP_SCHEDULE_DELAY"
ENV_TIMEOUT = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"
# Spans leave a process at most this often (the SDK's default is 5 s): a trace is complete in the collector soon
# after its request, and a process stopped by SIGKILL loses less. OTEL_BSP_SCHEDULE_DELAY overrides it.
SCHEDULE_DELAY_MS = 500
# How long one export may try (the SDK's default is 10 s, retries included); it runs in the processor's thread, and
# at shutdown the last flush waits for it, so an unreachable collector delays a process's exit by at most this.
# OTEL_EXPORTER_OTLP_TRACES_TIMEOUT overrides it.
EXPORT_TIMEOUT_S = 3.0

TRACER_NAME = "tandem"
_propagator = TraceContextTextMapPropagator()
_enabled = False
_tracer: trace.Tracer | None = None  # (set_tracer_provider comes first: setup_tracing)


class SpanAttributes:
    """Attribute names, vLLM's (vllm/tracing.py: the gen_ai.* semantic conventions and its own gen_ai.latency.*)
    where it has one."""
    REQUEST_ID = "gen_ai.request.id"
    MODEL = "gen_ai.response.model"
    MAX_TOKENS = "gen_ai.request.max_tokens"
    TEMPERATURE = "gen_ai.request.temperature"
    TOP_P = "gen_ai.request.top_p"
    N = "gen_ai.request.n"
    PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    FINISH_REASONS = "gen_ai.response.finish_reasons"
    TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    E2E = "gen_ai.latency.e2e"
    # Tandem's own
    ATTEMPT_ID = "tandem.request.attempt_id"
    CACHED_TOKENS = "tandem.usage.cached_tokens"
    KV_PATH = "tandem.kv_transfer.path"
    KV_BLOCKS = "tandem.kv_transfer.blocks"
    KV_BYTES = "tandem.kv_transfer.bytes"
    KV_SECONDS = "tandem.kv_transfer.seconds"
    KV_PEER = "tandem.kv_transfer.peer"
    RESERVED_BLOCKS = "tandem.decode.reserved_blocks"


def add_tracing_args(p: argparse.ArgumentParser) -> None:
    """`--otlp-traces-endpoint`, on every role and `tandem up` (declared once, here)."""
    p.add_argument(ENDPOINT_FLAG, default=None, metavar="URL",
                   help="send OpenTelemetry traces to this OTLP/gRPC collector, e.g. http://127.0.0.1:4317 "
                        f"(default: ${ENV_ENDPOINT}, else no tracing; OTEL_* variables apply)")


def tracing_flags(ns: argparse.Namespace) -> list[str]:
    """The tracing flag to pass on to a child process (`tandem up`), where given."""
    endpoint = getattr(ns, "otlp_traces_endpoint", None)
    return [] if endpoint is None else [ENDPOINT_FLAG, endpoint]


def setup_tracing(role: str, endpoint: str | None = None) -> bool:
    """Installs the tracer provider of this process (service tandem-<role>) when an endpoint is given by the flag
    or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; returns whether tracing is on. Without one nothing is installed."""
    global _enabled, _tracer
    endpoint = endpoint or os.environ.get(ENV_ENDPOINT)
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = os.environ.get(ENV_SERVICE_NAME) or f"tandem-{role}"
    timeout = float(os.environ.get(ENV_TIMEOUT, EXPORT_TIMEOUT_S))
    delay = int(os.environ.get(ENV_SCHEDULE_DELAY, SCHEDULE_DELAY_MS))
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://") or None, timeout=timeout)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay))
    trace.set_tracer_provider(provider)  # (the SDK flushes and shuts it down at exit)
    _enabled, _tracer = True, None
    log.info("tracing: OTLP/gRPC spans to %s as service %s", endpoint, service)
    return True


def enabled() -> bool:
    return _enabled


def tracer() -> trace.Tracer:
    global _tracer
    if _tracer is None:
        _tracer = trace.get_tracer(TRACER_NAME)
    return _tracer


# ---- the W3C trace context on the wire ----------------------------------------------------------------------
def metadata(ctx: otel_context.Context | None = None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying ctx's span (default: the current one), for a call's `metadata=`; None when tracing is
    off or there is no span."""
    if not _enabled:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return tuple(carrier.items()) or None


def span_metadata(span: trace.Span) -> tuple[tuple[str, str], ...] | None:
    return metadata(trace.set_span_in_context(span)) if _enabled else None


class _LowerGetter(DefaultGetter):
    def get(self, carrier, key):
        value = carrier.get(key.lower())
        return None if value is None else [value]


def parent_from(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context a `traceparent` (and `tracestate`) in headers names: HTTP headers (case-insensitive: starlette's
    lowercase them) or a dict of gRPC metadata. None when tracing is off or there is none."""
    if not _enabled or not headers:
        return None
    carrier = {k.lower(): v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
    if not carrier:
        return None
    return _propagator.extract(carrier, getter=_LowerGetter())


def grpc_parent(context) -> otel_context.Context | None:
    """The parent context a gRPC call's metadata names (context: the servicer's ServicerContext)."""
    if not _enabled:
        return None
    md = context.invocation_metadata() or ()
    return parent_from({k: v for k, v in md if isinstance(v, str)})


# ---- spans ----------------------------------------------------------------------------------------------------
def start_span(name: str, parent: otel_context.Context | None = None, kind: SpanKind = SpanKind.INTERNAL,
               attributes: Mapping | None = None) -> trace.Span:
    """A span the caller ends (`end_span`): for work that spans an async generator's yields, where a `with` of
    the current span would be entered and left in different contexts. Tracing off: the one invalid span, whose
    methods do nothing (not even the API's no-op tracer is asked)."""
    if not _enabled:
        return trace.INVALID_SPAN
    return tracer().start_span(name, context=parent, kind=kind, attributes=attributes)


def end_span(span: trace.Span, exc: BaseException | None = None) -> None:
    if not span.is_recording():
        return
    if exc is not None:
        if isinstance(exc, Exception):
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        else:  # cancelled (a client or caller went away)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
    span.end()


_answered: set[int] = set()  # server spans (by id) whose call has handed out its last message


def answered(span: trace.Span) -> None:
    """A streaming call is about to hand out its last message: a caller that ends the call once it has it (the
    router stops reading a Decode stream at the finished delta) cancels a call that succeeded, not a failed one."""
    _answered.add(id(span))


@contextlib.contextmanager
def server_span(name: str, context, attributes: Mapping | None = None) -> Iterator[trace.Span]:
    """A SERVER span for one gRPC call (context: its ServicerContext; the parent is in its metadata), ended when
    the block ends, with the error that ended it (a cancellation after `answered` is none). Not made current: see
    start_span."""
    span = start_span(name, grpc_parent(context), SpanKind.SERVER, attributes)
    try:
        yield span
    except BaseException as e:
        done = id(span) in _answered and isinstance(e, (GeneratorExit, asyncio.CancelledError))
        end_span(span, None if done else e)
        raise
    else:
        end_span(span)
    finally:
        _answered.discard(id(span))


@contextlib.contextmanager
def current(span: trace.Span) -> Iterator[None]:
    """Makes span the current one inside the block (a coroutine's, not an async generator's), so that calls made
    there (`metadata()`) and spans started there are its children; the span is not ended."""
    if not _enabled:
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)
