"""OpenTelemetry traces end to end: `tandem up --otlp-traces-endpoint` (router, one prefill, one decode worker) exports
its spans with the real OTLP exporter to a real OTLP/gRPC collector on loopback (otlp_collector.py). A client's
`traceparent` (HTTP header, gRPC metadata) is the parent of the router's span; the prefill, KV transfer and decode
spans of the three processes hang below it in one trace. The timing breakdown comes back when asked. Once the
collector is gone, requests are served as before and the stack still stops cleanly."""
from __future__ import annotations

import json
import secrets
import time

import grpc
import httpx
import pytest

from otlp_collector import Collector
from protos.tandem.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from stack import Stack

SPANS = {"llm_request", "prefill", "kv_transfer.send", "kv_transfer.receive", "decode"}
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
TIMINGS = {"queue_s", "prefill_s", "kv_transfer_s", "first_token_s", "mean_itl_s", "decode_s"}
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def traced():
    collector = Collector().start()
    stack = Stack("--model", "random:tiny", "--otlp-traces-endpoint", collector.endpoint, prefill=1, decode=1)
    try:
        yield stack.wait_ready(), collector
    finally:
        stack.stop()
        collector.stop()


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _check_tree(collector: Collector, trace_id: str, client_span: str, request_id: str, prompt_tokens: int):
    got = collector.wait_for(trace_id, SPANS)
    spans = collector.of_trace(trace_id)
    assert sorted(s.name for s in spans) == sorted(SPANS), [s.name for s in spans]  # one of each, nothing else
    router, prefill, send = got["llm_request"], got["prefill"], got["kv_transfer.send"]
    receive, decode = got["kv_transfer.receive"], got["decode"]
    # Who exported each span, and the parent of each.
    assert (router.service, prefill.service, send.service) == ("tandem-router", "tandem-prefill", "tandem-prefill")
    assert (receive.service, decode.service) == ("tandem-decode", "tandem-decode")
    assert router.parent_span_id == client_span and router.kind == SERVER
    assert prefill.parent_span_id == router.span_id and prefill.kind == SERVER
    assert decode.parent_span_id == router.span_id and decode.kind == SERVER
    assert send.parent_span_id == prefill.span_id and send.kind == CLIENT
    assert receive.parent_span_id == send.span_id and receive.kind == SERVER
    assert all(s.status_code != 2 for s in spans), [(s.name, s.status_code) for s in spans]  # none is an error
    # The attributes (vLLM's gen_ai.* names on the router's span).
    a = router.attributes
    assert a["gen_ai.request.id"] == request_id
    assert a["gen_ai.response.model"] == "random:tiny"
    assert a["gen_ai.request.max_tokens"] == MAX_TOKENS and a["gen_ai.request.n"] == 1
    assert a["gen_ai.usage.prompt_tokens"] == prompt_tokens
    assert a["gen_ai.usage.completion_tokens"] == MAX_TOKENS
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.latency.time_in_queue"] >= 0
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert "first_token" in router.events and "first_token" in prefill.events
    assert prefill.attributes["tandem.request.attempt_id"] == request_id
    assert prefill.attributes["gen_ai.usage.prompt_tokens"] == prompt_tokens
    assert send.attributes["tandem.kv_transfer.path"] == "grpc"
    assert send.attributes["tandem.kv_transfer.blocks"] == receive.attributes["tandem.kv_transfer.blocks"] > 0
    assert send.attributes["tandem.kv_transfer.bytes"] == receive.attributes["tandem.kv_transfer.bytes"] > 0
    assert decode.attributes["tandem.decode.reserved_blocks"] > 0
    assert decode.attributes["gen_ai.usage.completion_tokens"] == MAX_TOKENS


def _check_timings(t: dict) -> None:
    assert set(t) == TIMINGS
    assert all(v >= 0 for v in t.values()), t
    assert t["kv_transfer_s"] > 0  # (the request went through a transfer)
    assert t["first_token_s"] >= t["queue_s"] + t["prefill_s"] - 1e-6
    assert t["mean_itl_s"] * (MAX_TOKENS - 1) == pytest.approx(t["decode_s"])


@pytest.mark.slow
def test_http_request_is_one_trace_across_the_three_processes(traced):
    stack, collector = traced
    header, trace_id, client_span = _traceparent()
    r = httpx.post(f"{stack.http}/v1/completions", headers={"traceparent": header}, timeout=60, json={
        "model": "random:tiny", "prompt": "one two three four five six seven eight nine ten " * 4,
        "max_tokens": MAX_TOKENS, "temperature": 0, "return_timings": True})
    assert r.status_code == 200, r.text
    body = r.json()
    _check_timings(body["choices"][0]["timings"])
    _check_tree(collector, trace_id, client_span, body["id"], body["usage"]["prompt_tokens"])


@pytest.mark.slow
def test_grpc_request_takes_its_parent_from_metadata_and_returns_timings(traced):
    stack, collector = traced
    header, trace_id, client_span = _traceparent()
    with grpc.insecure_channel(stack.grpc) as ch:
        responses = list(generate_pb2_grpc.GenerateStub(ch).Generate(generate_pb2.GenerateRequest(
            model="random:tiny", prompt="alpha beta gamma delta " * 6, return_timings=True,
            params=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)),
            metadata=[("traceparent", header)], timeout=60))
    last = responses[-1]
    assert last.delta.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert all(not r.HasField("timings") for r in responses[:-1])
    _check_timings({f: getattr(last.timings, f) for f in TIMINGS})
    _check_tree(collector, trace_id, client_span, last.request_id, last.usage.prompt_tokens)


@pytest.mark.slow
def test_no_timings_unless_asked_and_a_request_without_traceparent_starts_a_trace(traced):
    stack, collector = traced
    r = httpx.post(f"{stack.http}/v1/chat/completions", timeout=60, json={
        "model": "random:tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert "timings" not in r.json()["choices"][0]
    rid, deadline = r.json()["id"], time.monotonic() + 60
    while not (mine := [s for s in collector.spans if s.attributes.get("gen_ai.request.id") == rid]):
        assert time.monotonic() < deadline, "the request's span never arrived"
        time.sleep(0.1)
    assert mine[0].name == "llm_request" and mine[0].parent_span_id == ""  # a root: the trace starts here


@pytest.mark.slow
def test_a_stream_carries_the_timings_on_each_choices_last_chunk(traced):
    stack, _ = traced
    with httpx.stream("POST", f"{stack.http}/v1/chat/completions", timeout=60, json={
            "model": "random:tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": MAX_TOKENS,
            "n": 2, "temperature": 0, "stream": True, "return_timings": True}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c for chunk in chunks for c in chunk["choices"]]
    last = {c["index"]: c for c in choices if c["finish_reason"] is not None}
    assert sorted(last) == [0, 1]
    for c in last.values():
        _check_timings(c["timings"])
    assert all("timings" not in c for c in choices if c["finish_reason"] is None)


@pytest.mark.slow
def test_an_unreachable_collector_fails_no_request(traced):
    """Runs last: the collector goes away; the exporter's failures stay in its own thread."""
    stack, collector = traced
    collector.stop()
    for i in range(3):
        header, _, _ = _traceparent()
        r = httpx.post(f"{stack.http}/v1/completions", headers={"traceparent": header}, timeout=60, json={
            "model": "random:tiny", "prompt": f"request {i} " * 8, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    assert stack.stop() == 0
