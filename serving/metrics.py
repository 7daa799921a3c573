"""Prometheus metrics shared by the three roles (router, prefill, decode).

Names, types, buckets and the `model_name` label are vLLM's (`vllm:<name>` is `<prefix>:<name>`, the prefix
`tandem` unless `--metrics-prefix` says otherwise: `--metrics-prefix vllm` serves exactly vLLM's names, for the
dashboards, autoscalers and gateways written against them). Every series also carries `role` ("router" |
"prefill" | "decode" | "colocated": the engine inside `tandem router --colocated`). Counters are exported by
prometheus_client with the `_total` suffix, as vLLM's are (`tandem:prompt_tokens_total`).

Where each series is observed (docs/operations.md, "Metrics", has the table):
- request-level (`REQUEST_ROLES`: the router's core, router/metrics.py): TTFT, inter-token latency, TPOT, e2e,
  queue/prefill/decode/inference time, prompt and generation tokens per request, n and max_tokens: once per
  request whether the stack is disaggregated or colocated, because both go through the router's core;
- engine-level (every engine role): running/waiting requests, KV-cache usage, prefix cache, preemptions,
  tokens per engine step (`iteration_tokens_total`), `cache_config_info`;
- the prefill and decode workers' own view of their part (prefill: TTFT, prompt tokens; decode: inter-token latency,
  generation tokens, e2e, finished requests), told apart from the router's by `role`.
A role exports only the families it records: the colocated engine has no request-level series at 0 beside the
router's.

Families are created on first use (`Family`), so that `set_prefix` (from `--metrics-prefix`, in each role's main)
names them; the objects live in the default registry, exposed by `start_metrics_server(port)` (prefill and
decode: `--metrics-port`) or `prometheus_client.generate_latest()` (the router's FastAPI /metrics).
"""
from __future__ import annotations

import argparse
import http.server
import re
import threading
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, REGISTRY, Counter, Gauge, Histogram, generate_latest

DEFAULT_PREFIX = "tandem"
LABELS = ("model_name", "role")
ROLES = ("router", "prefill", "decode", "colocated")
ENGINE_ROLES = ("prefill", "decode", "colocated")
REQUEST_ROLES = ("router",)

_PREFIX_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_prefix = DEFAULT_PREFIX
DECLARED: list["Family"] = []  # every family declared, in any module (tests check dashboards and alerts against it)
_created: list["Family"] = []


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    """--metrics-prefix, on every role and `tandem up` (declared once, here)."""
    p.add_argument("--metrics-prefix", default=DEFAULT_PREFIX,
                   help="the Prometheus metric names' prefix, `<prefix>:<name>`; `vllm` serves vLLM's names "
                        f"(vllm:time_to_first_token_seconds ...) for tools written against them (default: "
                        f"{DEFAULT_PREFIX})")


def set_prefix(prefix: str) -> None:
    """Names every family `<prefix>:<name>`; before the first is created (a role's main calls it first)."""
    global _prefix
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"--metrics-prefix={prefix!r}: must be a letter or _ then letters, digits or _ "
                         "(the name becomes <prefix>:<metric>)")
    if _created and prefix != _prefix:
        raise RuntimeError(f"metrics prefix {prefix!r} set after {_created[0].name!r} was created as {_prefix!r}")
    _prefix = prefix


def prefix() -> str:
    return _prefix


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class Family:
    """One metric family, created in the default registry under the process's prefix when first used."""

    def __init__(self, kind: type, name: str, doc: str, labels: tuple[str, ...] = LABELS,
                 roles: tuple[str, ...] = ROLES, buckets: tuple | Callable[[int], list] | None = None):
        self.kind, self.name, self.doc, self.labelnames, self.roles = kind, name, doc, labels, roles
        self.buckets = buckets
        self._metric = None
        DECLARED.append(self)

    def metric(self, max_model_len: int | None = None):
        if self._metric is None:
            kw = {}
            if callable(self.buckets):  # token counts: buckets up to the context length, as vLLM's
                assert max_model_len is not None, self.name
                kw["buckets"] = self.buckets(max_model_len)
            elif self.buckets is not None:
                kw["buckets"] = self.buckets
            self._metric = self.kind(f"{_prefix}:{self.name}", self.doc, self.labelnames, **kw)
            _created.append(self)
        return self._metric

    def labels(self, *args, **kwargs):
        return self.metric().labels(*args, **kwargs)


# Buckets as vLLM's (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_ALL_BUT_COLOCATED = ("router", "prefill", "decode")
_KV_ROLES = ("prefill", "decode")

# attribute -> its family (the attribute of `Metrics` that holds this process's child).
FAMILIES = {
    "num_requests_running": Family(Gauge, "num_requests_running",
                                   "Requests in the running batch (router: its requests in flight)."),
    "num_requests_waiting": Family(Gauge, "num_requests_waiting",
                                   "Requests waiting (router: for an admission slot; prefill: queued; decode: "
                                   "reserved, KV not yet arrived).", ),
    "kv_cache_usage_perc": Family(Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  roles=ENGINE_ROLES),
    "num_preemptions": Family(Counter, "num_preemptions", "Cumulative number of preemption from the engine.",
                              roles=ENGINE_ROLES),
    "prefix_cache_queries": Family(Counter, "prefix_cache_queries",
                                   "Prefix cache queries, in terms of number of queried tokens.", roles=ENGINE_ROLES),
    "prefix_cache_hits": Family(Counter, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                roles=ENGINE_ROLES),
    # The host KV tier (--swap-space), vLLM's v0 names where it had one.
    "cpu_cache_usage_perc": Family(Gauge, "cpu_cache_usage_perc",
                                   "Host KV tier usage (--swap-space). 1 means 100 percent usage.", roles=ENGINE_ROLES),
    "num_requests_swapped": Family(Gauge, "num_requests_swapped",
                                   "Preempted requests whose KV waits in the host tier.", roles=ENGINE_ROLES),
    "num_swaps": Family(Counter, "num_swaps", "Preemptions that swapped the request's KV to the host tier instead "
                        "of recomputing it.", roles=ENGINE_ROLES),
    "kv_swapped_out_blocks": Family(Counter, "kv_swapped_out_blocks",
                                    "KV blocks of preempted requests copied to the host tier.", roles=ENGINE_ROLES),
    "kv_swapped_in_blocks": Family(Counter, "kv_swapped_in_blocks",
                                   "KV blocks of preempted requests copied back from the host tier.",
                                   roles=ENGINE_ROLES),
    "cpu_prefix_cache_stored_blocks": Family(Counter, "cpu_prefix_cache_stored_blocks",
                                             "Prefix-cache blocks evicted from the device and kept in the host tier.",
                                             roles=ENGINE_ROLES),
    "cpu_prefix_cache_hits": Family(Counter, "cpu_prefix_cache_hits",
                                    "Prefix cache hits served from the host tier, in tokens (also counted in "
                                    "prefix_cache_hits).", roles=ENGINE_ROLES),
    "iteration_tokens_total": Family(Histogram, "iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.", roles=ENGINE_ROLES,
                                     buckets=_ITERATION_TOKEN_BUCKETS),
    "time_to_first_token_seconds": Family(Histogram, "time_to_first_token_seconds",
                                          "Histogram of time to first token in seconds.",
                                          roles=("router", "prefill"), buckets=_TTFT_BUCKETS),
    "inter_token_latency_seconds": Family(Histogram, "inter_token_latency_seconds",
                                          "Histogram of inter-token latency in seconds.",
                                          roles=("router", "decode"), buckets=_ITL_BUCKETS),
    "time_per_output_token_seconds": Family(Histogram, "time_per_output_token_seconds",
                                            "Histogram of time per output token in seconds.", roles=REQUEST_ROLES,
                                            buckets=_ITL_BUCKETS),
    "e2e_request_latency_seconds": Family(Histogram, "e2e_request_latency_seconds",
                                          "Histogram of e2e request latency in seconds.",
                                          roles=("router", "decode"), buckets=_REQUEST_BUCKETS),
    "request_queue_time_seconds": Family(Histogram, "request_queue_time_seconds",
                                         "Histogram of time spent in WAITING phase for request.", roles=REQUEST_ROLES,
                                         buckets=_REQUEST_BUCKETS),
    "request_prefill_time_seconds": Family(Histogram, "request_prefill_time_seconds",
                                           "Histogram of time spent in PREFILL phase for request.",
                                           roles=REQUEST_ROLES, buckets=_REQUEST_BUCKETS),
    "request_decode_time_seconds": Family(Histogram, "request_decode_time_seconds",
                                          "Histogram of time spent in DECODE phase for request.", roles=REQUEST_ROLES,
                                          buckets=_REQUEST_BUCKETS),
    "request_inference_time_seconds": Family(Histogram, "request_inference_time_seconds",
                                             "Histogram of time spent in RUNNING phase for request.",
                                             roles=REQUEST_ROLES, buckets=_REQUEST_BUCKETS),
    "request_prompt_tokens": Family(Histogram, "request_prompt_tokens", "Number of prefill tokens processed.",
                                    roles=REQUEST_ROLES, buckets=build_1_2_5_buckets),
    "request_generation_tokens": Family(Histogram, "request_generation_tokens",
                                        "Number of generation tokens processed.", roles=REQUEST_ROLES,
                                        buckets=build_1_2_5_buckets),
    "request_params_n": Family(Histogram, "request_params_n", "Histogram of the n request parameter.",
                               roles=REQUEST_ROLES, buckets=_N_BUCKETS),
    "request_params_max_tokens": Family(Histogram, "request_params_max_tokens",
                                        "Histogram of the max_tokens request parameter.", roles=REQUEST_ROLES,
                                        buckets=build_1_2_5_buckets),
    "prompt_tokens": Family(Counter, "prompt_tokens", "Number of prefill tokens processed.",
                            roles=("router", "prefill")),
    "generation_tokens": Family(Counter, "generation_tokens", "Number of generation tokens processed.",
                                roles=("router", "decode")),
    "kv_transfer_bytes": Family(Counter, "kv_transfer_bytes", "KV payload bytes sent (prefill) or received (decode).",
                                roles=_KV_ROLES),
    "kv_transfer_seconds": Family(Histogram, "kv_transfer_seconds", "KV transfer time, open to ack, seconds.",
                                  roles=_KV_ROLES, buckets=_TRANSFER_BUCKETS),
    "kv_transfer_tail_seconds": Family(
        Histogram, "kv_transfer_tail_seconds",
        "Prefill: from the first token to decode's ack, seconds: the part of a transfer not hidden behind prefill "
        "compute (it delays the second token, never the first).", roles=_KV_ROLES, buckets=_TRANSFER_BUCKETS),
    "kv_transfer_failures": Family(Counter, "kv_transfer_failures",
                                   "KV transfers that failed (deadline, layout mismatch, peer gone, cancelled).",
                                   roles=_KV_ROLES),
}
request_success = Family(Counter, "request_success", "Count of successfully processed requests.",
                         LABELS + ("finished_reason",), roles=("router", "decode"))
request_migrations = Family(
    Counter, "request_migrations",
    "Router: streams moved to another instance after the one serving them failed, by reason (decode_unavailable: "
    "the decode stream broke or ended early; decode_unhealthy: the health poll lost the decode instance; "
    "prefill_unavailable: the prefill instance failed; kv_transfer: the transfer between them failed or missed its "
    "deadline).", LABELS + ("reason",), roles=REQUEST_ROLES)
# vLLM's info-style gauge: always 1, the engine's cache configuration in its labels.
CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                       "num_gpu_blocks", "num_gpu_blocks_override")
cache_config_info = Family(Gauge, "cache_config_info", "Information of the LLMEngine CacheConfig",
                           LABELS + CACHE_CONFIG_LABELS, roles=ENGINE_ROLES)

# Counter attribute -> the EngineStats total it follows.
_ENGINE_COUNTERS = {"prefix_cache_queries": "prefix_cache_queries", "prefix_cache_hits": "prefix_cache_hits",
                    "num_preemptions": "num_preemptions", "num_swaps": "num_swaps",
                    "kv_swapped_out_blocks": "swapped_out_blocks", "kv_swapped_in_blocks": "swapped_in_blocks",
                    "cpu_prefix_cache_stored_blocks": "host_stored_blocks", "cpu_prefix_cache_hits": "host_prefix_hits"}

router_instances = Family(
    Gauge, "router_instances",
    "Router: the prefill or decode instances it knows (instance_role), by state (healthy: in rotation and "
    "answering; unhealthy: in rotation, not answering or not serving; mismatched: answering, but with another "
    "vocabulary or tokenizer than the router, so not routed to; leaving: gone from DNS, calls "
    "still open there).", LABELS + ("instance_role", "state"), roles=("router",))

FINISHED_REASONS = ("stop", "length", "abort")
INSTANCE_STATES = ("healthy", "unhealthy", "mismatched", "leaving")
MIGRATION_REASONS = ("decode_unavailable", "decode_unhealthy", "prefill_unavailable", "kv_transfer")


class Metrics:
    """The metric children of one process, bound to its model_name and role labels. A family the role does not
    record is None here (and absent from /metrics), as are the token-count histograms without max_model_len (their
    buckets follow it: the router's core passes it; the router's other parts record none of them)."""

    def __init__(self, model: str, role: str, max_model_len: int | None = None):
        assert role in ROLES, role
        self.model, self.role = model, role
        lv = dict(model_name=model, role=role)
        self._totals = (0,) * len(_ENGINE_COUNTERS)  # the engine's counters already counted
        for attr, family in FAMILIES.items():
            wanted = role in family.roles and (max_model_len is not None or not callable(family.buckets))
            setattr(self, attr, family.metric(max_model_len).labels(**lv) if wanted else None)
        # Every reason's series exists from the start (at 0), so a dashboard's rate() is 0, not "no data".
        self.request_success = ({r: request_success.labels(finished_reason=r, **lv) for r in FINISHED_REASONS}
                                if role in request_success.roles else None)
        self.request_migrations = ({r: request_migrations.labels(reason=r, **lv) for r in MIGRATION_REASONS}
                                   if role in request_migrations.roles else None)

    def set_router_instances(self, instance_role: str, **counts: int) -> None:
        """tandem:router_instances of one pool: counts by state (INSTANCE_STATES)."""
        for state, n in counts.items():
            assert state in INSTANCE_STATES, state
            router_instances.labels(model_name=self.model, role=self.role, instance_role=instance_role,
                                    state=state).set(n)

    def observe_step(self, stats) -> None:
        """One engine step's gauges and counters from an `EngineStats` snapshot (its counters are totals)."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        if stats.num_step_tokens:
            self.iteration_tokens_total.observe(stats.num_step_tokens)
        host_blocks = getattr(stats, "num_host_blocks", 0)  # (0: no host tier)
        self.cpu_cache_usage_perc.set(stats.num_host_used_blocks / host_blocks if host_blocks else 0.0)
        self.num_requests_swapped.set(getattr(stats, "num_swapped", 0))
        totals = tuple(getattr(stats, name, 0) for name in _ENGINE_COUNTERS.values())
        for attr, now, before in zip(_ENGINE_COUNTERS, totals, self._totals):
            getattr(self, attr).inc(now - before)
        self._totals = totals

    def observe_cache_config(self, cache, num_gpu_blocks: int) -> None:
        """cache_config_info from an engine's CacheConfig and the KV blocks it got."""
        info = dict(block_size=cache.block_size, cache_dtype=cache.kv_cache_dtype,
                    enable_prefix_caching=cache.enable_prefix_caching,
                    gpu_memory_utilization=cache.gpu_memory_utilization, num_gpu_blocks=num_gpu_blocks,
                    num_gpu_blocks_override=cache.num_gpu_blocks_override)
        cache_config_info.labels(model_name=self.model, role=self.role, **{k: str(v) for k, v in info.items()}).set(1)

    def finished(self, reason: str | None) -> None:
        self.request_success[reason if reason in self.request_success else "abort"].inc()


def exposition() -> tuple[bytes, str]:
    """The default registry in text format 0.0.4 and its Content-Type: what every role's /metrics answers."""
    return generate_latest(REGISTRY), CONTENT_TYPE_PLAIN_0_0_4


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    """GET /metrics in Prometheus's text format 0.0.4, whatever the scraper's Accept header says, as the router's
    /metrics answers. (prometheus_client's own server negotiates OpenMetrics with escaping=underscores for a
    Prometheus 2.x scrape, which writes `tandem:x` samples as `tandem_x` under a `tandem:x` HELP line: the series
    would be stored under another name than the router's and the dashboards query. Prometheus 3.x asks for
    `escaping=allow-utf-8` first and takes 0.0.4 as well: colons are legal in 0.0.4 names, nothing is escaped.)"""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body, content_type = exposition()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
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
