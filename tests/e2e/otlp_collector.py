"""A real OTLP/gRPC trace collector for the end-to-end tests: opentelemetry-proto's TraceService on 127.0.0.1, keeping
every span it is sent (the processes under test export to it with their real OTLP exporter)."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    service: str
    name: str
    kind: int
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict
    events: list[str] = field(default_factory=list)
    status_code: int = 0


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):
        for rs in request.resource_spans:
            attrs = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    span = Span(attrs.get("service.name", ""), s.name, s.kind, s.trace_id.hex(), s.span_id.hex(),
                                s.parent_span_id.hex(), {kv.key: _value(kv.value) for kv in s.attributes},
                                [e.name for e in s.events], s.status.code)
                    with self.lock:
                        self.spans.append(span)
        return trace_service_pb2.ExportTraceServiceResponse()

    def start(self) -> "Collector":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None)

    def of_trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 60.0) -> dict[str, Span]:
        """The spans of trace_id by name, once every one of `names` arrived (AssertionError at the deadline)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.of_trace(trace_id)
            got = {s.name: s for s in spans}
            if names <= set(got) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert names <= set(got), f"spans of {trace_id}: {sorted(got)}, wanted {sorted(names)}"
        return got
