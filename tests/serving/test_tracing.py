"""serving/tracing.py in one process: off by default (no provider, no metadata), the W3C context in and out of gRPC
metadata and HTTP headers, a span's error status, and an unreachable collector that costs a span's end nothing.
Each test that turns tracing on runs in a child interpreter: OpenTelemetry's global provider is set once a process."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, env: dict[str, str] | None = None) -> str:
    import os

    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                         env={**base, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_off_without_an_endpoint_installs_nothing_and_adds_no_metadata():
    out = _run("""
        from opentelemetry import trace
        from serving import tracing
        assert tracing.setup_tracing("router", None) is False
        assert not tracing.enabled()
        assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"  # the API's no-op default
        span = tracing.start_span("llm_request", tracing.parent_from({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}))
        assert not span.is_recording()
        with tracing.current(span):
            assert tracing.metadata() is None
        assert tracing.span_metadata(span) is None
        tracing.end_span(span, ValueError("x"))
        print("ok")
    """)
    assert out.strip() == "ok"


def test_the_env_variable_turns_it_on_and_names_the_service():
    out = _run("""
        from opentelemetry import trace
        from serving import tracing
        assert tracing.setup_tracing("decode", None) is True
        provider = trace.get_tracer_provider()
        print(provider.resource.attributes["service.name"])
    """, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9", "OTEL_SERVICE_NAME": "my-decode"})
    assert out.strip() == "my-decode"


def test_context_round_trip_through_metadata_and_headers():
    """The client's traceparent -> our span -> metadata of our calls -> the next process's parent."""
    out = _run("""
        from opentelemetry import trace
        from serving import tracing
        tracing.setup_tracing("router", "http://127.0.0.1:9")
        client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        parent = tracing.parent_from({"TraceParent": f"00-{client_trace}-{client_span}-01", "other": "x"})
        span = tracing.start_span("llm_request", parent, tracing.SpanKind.SERVER)
        ctx = span.get_span_context()
        assert format(ctx.trace_id, "032x") == client_trace
        assert format(span.parent.span_id, "016x") == client_span
        with tracing.current(span):
            md = dict(tracing.metadata())
        assert md == dict(tracing.span_metadata(span))
        assert md["traceparent"] == f"00-{client_trace}-{format(ctx.span_id, '016x')}-01"

        class Ctx:  # a servicer's context: the metadata as the next process receives it
            def invocation_metadata(self):
                return tuple(md.items()) + (("x-other", "y"),)
        with tracing.server_span("prefill", Ctx()) as child:
            assert child.parent.span_id == ctx.span_id and child.get_span_context().trace_id == ctx.trace_id
        assert tracing.parent_from({"traceparent": "garbage"}) is not None  # (an invalid one: a new trace)
        assert tracing.parent_from({}) is None
        print("ok")
    """)
    assert out.strip() == "ok"


# A child's tracing set up with an in-memory exporter (`memory`) and a ServicerContext without metadata (`Ctx`).
_IN_MEMORY = """
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from serving import tracing
        memory = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(memory))
        trace.set_tracer_provider(provider)
        tracing._enabled = True

        class Ctx:
            def invocation_metadata(self):
                return ()
"""


def test_a_failed_block_ends_its_span_with_the_error():
    out = _run(_IN_MEMORY + """
        try:
            with tracing.server_span("decode", Ctx()):
                raise ValueError("max_tokens=0: must be >= 1")
        except ValueError:
            pass
        (span,) = memory.get_finished_spans()
        print(span.name, span.status.status_code.name, span.events[0].name)
    """)
    assert out.split() == ["decode", "ERROR", "exception"]


def test_a_stream_cancelled_after_its_last_message_is_no_error():
    """The router ends a Decode call once it has the finished delta: a cancellation after `answered` ends the span
    without an error; before it (a caller gone mid-stream) the span says so."""
    out = _run(_IN_MEMORY + """
        import asyncio

        async def stream(name, last):
            with tracing.server_span(name, Ctx()) as span:
                for i in range(3):
                    if i == 2 and last:
                        tracing.answered(span)
                    yield i

        async def main():
            for name, last in (("answered", True), ("mid-stream", False)):
                gen = stream(name, last)
                for _ in range(3 if last else 2):
                    await anext(gen)
                await gen.aclose()  # the caller ends the call (GeneratorExit at the yield)
        asyncio.run(main())
        print(*(f"{s.name}:{s.status.status_code.name}" for s in memory.get_finished_spans()))
        print(len(tracing._answered))
    """)
    assert out.split() == ["answered:UNSET", "mid-stream:ERROR", "0"]


def test_a_collector_that_never_answers_does_not_hold_up_spans():
    """Ending a span only queues it (BatchSpanProcessor): with every export blocked, 200 spans still end, and the
    exports run in the processor's own thread, never in the one that ends the span."""
    out = _run("""
        import threading, time
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import SpanExportResult
        from serving import tracing
        release, threads = threading.Event(), []

        def export(self, spans, *args, **kwargs):
            threads.append(threading.current_thread())
            release.wait()
            return SpanExportResult.FAILURE
        OTLPSpanExporter.export = export
        tracing.setup_tracing("prefill", "http://127.0.0.1:9")
        for i in range(200):
            tracing.end_span(tracing.start_span(f"s{i}"))
        deadline = time.monotonic() + 60
        while not threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threads and threading.main_thread() not in threads, threads
        release.set()
        print("ok")
    """, {"OTEL_BSP_SCHEDULE_DELAY": "10"})
    assert out.strip() == "ok"
