"""Prometheus metrics shared by the three roles (router, prefill, decode).

Names follow vLLM's (`vllm:<name>` -> `tandem:<name>`), so a vLLM dashboard ports with one rename; every metric
carries the labels `model` (served model name) and `role` ("router" | "prefill" | "decode" | "colocated": the
engine inside `tandem router --colocated`, its step gauges kept apart from the router's own request metrics).
Counters are exported by prometheus_client with the `_total` suffix, as vLLM's are (`tandem:prompt_tokens_total`).

Each process creates one `Metrics(model, role)` and records into it; the metric objects live in the default
registry, so exposing them is `start_metrics_server(port)` (prefill and decode: `--metrics-port`, an HTTP server
answering GET /metrics) or `prometheus_client.generate_latest()` (the router's FastAPI /metrics).
"""
from __future__ import annotations

import http.server
import threading

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, REGISTRY, Counter, Gauge, Histogram, generate_latest

LABELS = ("model", "role")

# Buckets as vLLM's (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

num_requests_running = Gauge("tandem:num_requests_running", "Requests in the running batch.", LABELS)
num_requests_waiting = Gauge("tandem:num_requests_waiting",
                             "Requests waiting (prefill: queued; decode: reserved, KV not yet arrived).", LABELS)
kv_cache_usage_perc = Gauge("tandem:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", LABELS)
time_to_first_token_seconds = Histogram("tandem:time_to_first_token_seconds", "Time to the first token, seconds.",
                                        LABELS, buckets=_TTFT_BUCKETS)
inter_token_latency_seconds = Histogram("tandem:inter_token_latency_seconds", "Time between output tokens, seconds.",
                                        LABELS, buckets=_ITL_BUCKETS)
e2e_request_latency_seconds = Histogram("tandem:e2e_request_latency_seconds", "End-to-end request latency, seconds.",
                                        LABELS, buckets=_E2E_BUCKETS)
prompt_tokens = Counter("tandem:prompt_tokens", "Prefill tokens processed.", LABELS)
generation_tokens = Counter("tandem:generation_tokens", "Generation tokens processed.", LABELS)
request_success = Counter("tandem:request_success", "Finished requests, by finish reason.",
                          LABELS + ("finished_reason",))
num_preemptions = Counter("tandem:num_preemptions", "Cumulative preemptions by the scheduler.", LABELS)
prefix_cache_queries = Counter("tandem:prefix_cache_queries", "Prefix-cache queries, in tokens.", LABELS)
prefix_cache_hits = Counter("tandem:prefix_cache_hits", "Prefix-cache hits, in tokens.", LABELS)
kv_transfer_bytes = Counter("tandem:kv_transfer_bytes", "KV payload bytes sent (prefill) or received (decode).",
                            LABELS)
kv_transfer_seconds = Histogram("tandem:kv_transfer_seconds", "KV transfer time, open to ack, seconds.", LABELS,
                                buckets=_TRANSFER_BUCKETS)
kv_transfer_tail_seconds = Histogram(
    "tandem:kv_transfer_tail_seconds",
    "Prefill: from the first token to decode's ack, seconds: the part of a transfer not hidden behind prefill compute "
    "(it delays the second token, never the first).", LABELS, buckets=_TRANSFER_BUCKETS)
kv_transfer_failures = Counter("tandem:kv_transfer_failures",
                               "KV transfers that failed (deadline, layout mismatch, peer gone, cancelled).", LABELS)

request_migrations = Counter(
    "tandem:request_migrations",
    "Router: streams moved to another instance after the one serving them failed, by reason (decode_unavailable: "
    "the decode stream broke or ended early; decode_unhealthy: the health poll lost the decode instance; "
    "prefill_unavailable: the prefill instance failed; kv_transfer: the transfer between them failed or missed its "
    "deadline).", LABELS + ("reason",))

router_instances = Gauge(
    "tandem:router_instances",
    "Router: the prefill or decode instances it knows (instance_role), by state (healthy: in rotation and "
    "answering; unhealthy: in rotation, not answering or not serving; leaving: gone from DNS, calls still open "
    "there).", LABELS + ("instance_role", "state"))

FINISHED_REASONS = ("stop", "length", "abort")
INSTANCE_STATES = ("healthy", "unhealthy", "leaving")
MIGRATION_REASONS = ("decode_unavailable", "decode_unhealthy", "prefill_unavailable", "kv_transfer")
ROLES = ("router", "prefill", "decode", "colocated")


class Metrics:
    """The metric children of one process, bound to its model and role labels."""

    def __init__(self, model: str, role: str):
        assert role in ROLES, role
        lv = dict(model=model, role=role)
        self._model, self._role = model, role
        self._totals = (0, 0, 0)  # engine counters already counted: prefix queries, prefix hits, preemptions
        self.num_requests_running = num_requests_running.labels(**lv)
        self.num_requests_waiting = num_requests_waiting.labels(**lv)
        self.kv_cache_usage_perc = kv_cache_usage_perc.labels(**lv)
        self.time_to_first_token_seconds = time_to_first_token_seconds.labels(**lv)
        self.inter_token_latency_seconds = inter_token_latency_seconds.labels(**lv)
        self.e2e_request_latency_seconds = e2e_request_latency_seconds.labels(**lv)
        self.prompt_tokens = prompt_tokens.labels(**lv)
        self.generation_tokens = generation_tokens.labels(**lv)
        self.request_success = {r: request_success.labels(finished_reason=r, **lv) for r in FINISHED_REASONS}
        self.num_preemptions = num_preemptions.labels(**lv)
        self.prefix_cache_queries = prefix_cache_queries.labels(**lv)
        self.prefix_cache_hits = prefix_cache_hits.labels(**lv)
        self.kv_transfer_bytes = kv_transfer_bytes.labels(**lv)
        self.kv_transfer_seconds = kv_transfer_seconds.labels(**lv)
        self.kv_transfer_tail_seconds = kv_transfer_tail_seconds.labels(**lv)
        self.kv_transfer_failures = kv_transfer_failures.labels(**lv)
        # Every reason's series exists from the start (at 0), so a dashboard's rate() is 0, not "no data".
        self.request_migrations = {r: request_migrations.labels(reason=r, **lv) for r in MIGRATION_REASONS}

    def set_router_instances(self, instance_role: str, **counts: int) -> None:
        """tandem:router_instances of one pool: counts by state (INSTANCE_STATES)."""
        for state, n in counts.items():
            assert state in INSTANCE_STATES, state
            router_instances.labels(model=self._model, role=self._role, instance_role=instance_role,
                                    state=state).set(n)

    def observe_step(self, stats) -> None:
        """One engine step's gauges and counters from an `EngineStats` snapshot (its counters are totals)."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        totals = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)
        for counter, now, before in zip((self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions),
                                        totals, self._totals):
            counter.inc(now - before)
        self._totals = totals

    def finished(self, reason: str | None) -> None:
        self.request_success[reason if reason in self.request_success else "abort"].inc()


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    """GET /metrics in Prometheus's text format 0.0.4, whatever the scraper's Accept header says, as the router's
    /metrics answers. (prometheus_client's own server negotiates OpenMetrics with escaping=underscores for a
    Prometheus 2.x scrape, which writes `tandem:x` samples as `tandem_x` under a `tandem:x` HELP line: the series
    would be stored under another name than the router's and the dashboards query.)"""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # one line per scrape is noise
        pass


def start_metrics_server(port: int, host: str = "0.0.0.0") -> http.server.ThreadingHTTPServer | None:
    """Serves GET /metrics (the default registry) on host:port in a daemon thread; port 0 disables it."""
    if not port:
        return None
    server = http.server.ThreadingHTTPServer((host, port), _MetricsHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
