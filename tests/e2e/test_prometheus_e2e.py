"""Metrics as real scrapers read them: Debian's Prometheus (2.x) scrapes a live `tandem up` stack (router, one prefill
and one decode worker) every second, with docs/monitoring/alerts.yml loaded; after light load, every Grafana panel's
query and every alert's expression (its threshold stripped) returns series through Prometheus's HTTP API, the series
are stored under their `tandem:` names (no `tandem_` copies), and the rules are loaded and healthy. The Accept
headers Prometheus 2.x and 3.x send get text 0.0.4 from every process. `--colocated --metrics-prefix vllm` serves
vLLM's names and records each request once."""
from __future__ import annotations

import http.server
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from ports import free_port_block, free_ports
from stack import ROOT, Stack

PROMETHEUS = shutil.which("prometheus")
MONITORING = ROOT / "docs" / "monitoring"
DEADLINE_S = 120
RATE_WINDOW = "5m"  # the dashboard's $__rate_interval: the load stays inside it however slow the machine

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (Debian: prometheus)")]

# What Prometheus 3.x sends by default (scrape_protocols: OpenMetrics 1.0.0 and 0.0.1, text 1.0.0 and 0.0.4) and
# with PrometheusProto first (native histograms on); Prometheus 2.x's is recorded from the real one below.
ACCEPT_3X = ("application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
             "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,"
             "text/plain;version=0.0.4;q=0.2,*/*;q=0.1")
ACCEPT_3X_PROTO = ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.5,"
                   "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.4,"
                   "application/openmetrics-text;version=0.0.1;q=0.3,"
                   "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.2,text/plain;version=0.0.4;q=0.1,*/*;q=0.0")


class _AcceptProbe(http.server.BaseHTTPRequestHandler):
    """A scrape target that keeps the Accept header of each scrape."""
    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802
        self.seen.append(self.headers.get("Accept", ""))
        body = b"probe_up 1\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def poll(what: str, fn, deadline_s: float = DEADLINE_S):
    """fn() until it returns something truthy, or fail with its last value after deadline_s."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            assert value, f"{what}: still {value!r} after {deadline_s} s"
            return value
        time.sleep(0.5)


@pytest.fixture(scope="module")
def stack():
    s = Stack("--model", "random:tiny", prefill=1, decode=1).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def probe():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AcceptProbe)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def prometheus(stack, probe, tmp_path_factory):
    """Prometheus scraping the stack every second, with the shipped alert rules; its base URL."""
    tmp = tmp_path_factory.mktemp("prometheus")
    (port,) = free_ports(1)
    router = stack.http.removeprefix("http://")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(MONITORING / "alerts.yml")],
              "scrape_configs": [
                  {"job_name": "tandem-router", "static_configs": [{"targets": [router]}]},
                  {"job_name": "tandem-workers",
                   "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in stack.metrics_ports]}]},
                  {"job_name": "accept-probe",
                   "static_configs": [{"targets": [f"127.0.0.1:{probe.server_address[1]}"]}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-3000:]
        try:
            return httpx.get(f"{base}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    poll("prometheus ready", ready)
    yield base
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


def query(base: str, expr: str) -> list[dict]:
    r = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def value(base: str, expr: str) -> float | None:
    result = query(base, expr)
    return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def loaded(stack, prometheus):
    """Light load once every target is scraped: 4 requests, the last 2 sharing the first's 48-token prefix (the
    prefill worker's prefix cache has it), one with n=2. Returns (requests, completions)."""
    poll("every target up", lambda: len(query(prometheus, 'up{job=~"tandem-.*"} == 1')) == 1 + len(stack.metrics_ports))
    shared = list(range(100, 148))
    bodies = [{"prompt": "Once upon a time", "n": 2}] + [{"prompt": shared + [200 + k]} for k in range(3)]
    with httpx.Client(base_url=stack.http, timeout=120) as c:
        for body in bodies:
            r = c.post("/v1/completions", json={"model": "random:tiny", "max_tokens": 4, "ignore_eos": True,
                                                "temperature": 0, **body})
            assert r.status_code == 200, r.text
    return len(bodies), len(bodies) + 1


def test_the_router_and_the_workers_are_stored_under_their_colon_names(stack, prometheus, loaded):
    def jobs() -> set[str]:
        return {s["metric"]["job"] for s in query(prometheus, 'count by (job) ({__name__=~"tandem:.+"})')}

    poll("tandem: series from the router and the workers", lambda: jobs() == {"tandem-router", "tandem-workers"})
    assert query(prometheus, 'count({__name__=~"tandem_.+"})') == []  # no escaped copy of any family


def test_every_dashboard_panel_query_returns_series(prometheus, loaded):
    dashboard = json.loads((MONITORING / "grafana/dashboards/tandem.json").read_text())
    (variable,) = dashboard["templating"]["list"]
    model_query = variable["definition"]  # label_values(<metric>, model_name): Grafana's own lookup
    metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", model_query).groups()
    assert {s["metric"][label] for s in query(prometheus, metric)} == {"random:tiny"}
    exprs = {f'{p["title"]} / {t["legendFormat"]}': t["expr"].replace("$__rate_interval", RATE_WINDOW)
             .replace(f"${variable['name']}", "random:tiny")
             for p in dashboard["panels"] for t in p.get("targets", [])}
    assert len(exprs) >= 30
    empty = {}

    def all_answer() -> bool:
        empty.clear()
        empty.update({name: e for name, e in exprs.items() if not query(prometheus, e)})
        return not empty

    poll("panels without series", all_answer)
    # Not merely series: the router's client-facing latencies saw the load.
    ttft = value(prometheus, exprs["Time to first token / p50"])
    assert ttft is not None and math.isfinite(ttft) and ttft > 0


def test_every_alert_expression_returns_series_and_the_rules_are_healthy(prometheus, loaded):
    (group,) = yaml.safe_load((MONITORING / "alerts.yml").read_text())["groups"]
    raw = {r["alert"]: re.sub(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.e+-]+\s*$", "", r["expr"].strip())
           for r in group["rules"]}
    assert all(raw[name] != r["expr"].strip() for name, r in zip(raw, group["rules"]))  # a threshold was cut off
    poll("alert expressions without series", lambda: not [n for n, e in raw.items() if not query(prometheus, e)])

    def healthy():
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return ({r["name"] for r in rules} == set(raw) and
                all(r["health"] == "ok" and not r.get("lastError") for r in rules)) and rules

    rules = poll("alert rules loaded and evaluated", healthy)
    # Nothing is down, full or failing under light load: those alerts stay inactive (one that fired here would be
    # a broken rule). The TTFT alert is left out: on a slow enough machine, TTFT can truly exceed its threshold.
    states = {r["name"]: r["state"] for r in rules}
    quiet = ("TandemInstanceDown", "TandemInstanceMismatched", "TandemKvCacheNearlyFull", "TandemKvTransferFailures",
             "TandemQueueBacklog")
    assert {name: states[name] for name in quiet} == {name: "inactive" for name in quiet}


def test_request_series_are_recorded_once_per_request_by_the_router(prometheus, loaded):
    requests, completions = loaded
    expect = {"request_queue_time_seconds_count": requests, "request_params_n_count": requests,
              "time_to_first_token_seconds_count": requests, "e2e_request_latency_seconds_count": requests,
              "request_generation_tokens_count": completions, "request_prompt_tokens_count": completions}
    for name, want in expect.items():
        poll(name, lambda: value(prometheus, f'sum(tandem:{name}{{job="tandem-router"}})') == want, 30)
    # vLLM's request-phase series come from the router alone (the workers record no second copy).
    phases = 'count by (role) ({__name__=~"tandem:request_.+_seconds_count"})'
    roles = {s["metric"]["role"] for s in query(prometheus, phases)}
    assert roles == {"router"}
    # (the prefill worker is scraped apart from the router: its scrape since the last prompt may come later)
    poll("prefix cache hits", lambda: (value(prometheus, 'sum(tandem:prefix_cache_hits_total{role="prefill"})')
                                       or 0) >= 2 * 48, 30)
    blocks = query(prometheus, 'tandem:cache_config_info{role=~"prefill|decode"}')
    assert {s["metric"]["block_size"] for s in blocks} == {"16"} and len(blocks) == 2


def test_prometheus_2_and_3_accept_headers_get_text_0_0_4_with_colon_names(stack, probe, prometheus):
    recorded = poll("a scrape of the probe", lambda: list(_AcceptProbe.seen))[-1]
    assert "application/openmetrics-text" in recorded  # what prometheus_client would have answered in OpenMetrics
    urls = [f"{stack.http}/metrics"] + [f"http://127.0.0.1:{p}/metrics" for p in stack.metrics_ports]
    for accept in (recorded, ACCEPT_3X, ACCEPT_3X_PROTO):
        for url in urls:
            r = httpx.get(url, headers={"Accept": accept}, timeout=10)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4"), (
                url, accept, r.headers)
            lines = r.text.splitlines()
            assert any(line.startswith("tandem:num_requests_running{") for line in lines), url
            assert not [line for line in lines if line.startswith("tandem_")], url


# ------------------------------------------------------------------------------------------------ colocated, vllm:
VLLM_SERIES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
               "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
               "request_success_total", "iteration_tokens_total_bucket", "time_to_first_token_seconds_bucket",
               "time_per_output_token_seconds_bucket", "inter_token_latency_seconds_bucket",
               "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
               "request_prefill_time_seconds_bucket", "request_decode_time_seconds_bucket",
               "request_inference_time_seconds_bucket", "request_prompt_tokens_bucket",
               "request_generation_tokens_bucket", "request_params_n_bucket", "request_params_max_tokens_bucket",
               "cache_config_info")


def test_colocated_with_the_vllm_prefix_serves_vllm_names_once_per_request():
    base = free_port_block(2)
    proc = subprocess.Popen([sys.executable, "-m", "cli", "up", "--colocated", "--model", "random:tiny",
                             "--metrics-prefix", "vllm", "--http-port", str(base), "--grpc-port", str(base + 1)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{base}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, "tandem up --colocated exited"
            try:
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        poll("colocated router healthy", ready, 240)
        with httpx.Client(base_url=url, timeout=120) as c:
            prompt = list(range(100, 140))  # 2 full blocks and a part: the third request finds them cached
            for body in ({"prompt": "Once upon a time", "n": 2}, {"prompt": prompt}, {"prompt": prompt}):
                r = c.post("/v1/completions", json={"model": "random:tiny", "max_tokens": 3, "ignore_eos": True,
                                                    "temperature": 0, **body})
                assert r.status_code == 200, r.text
        text = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    samples = [(m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")), float(m.group(3)))
               for m in re.finditer(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$", text, re.M)]
    names = {n for n, _, _ in samples}
    assert not [n for n in names if n.startswith("tandem")], "the tandem prefix is gone everywhere"
    missing = [s for s in VLLM_SERIES if f"vllm:{s}" not in names]
    assert not missing, missing
    assert all(labels.get("model_name") == "random:tiny" for n, labels, _ in samples
               if n.startswith("vllm:") and not n.startswith("vllm:http_requests"))

    def total(name: str, **match) -> float:
        return sum(v for n, labels, v in samples
                   if n == f"vllm:{name}" and all(labels.get(k) == w for k, w in match.items()))

    # Once per request (3) or per completion (4), whichever role would have recorded it: not twice.
    assert total("request_queue_time_seconds_count") == 3 and total("e2e_request_latency_seconds_count") == 3
    assert total("time_to_first_token_seconds_count") == 3 and total("request_success_total") == 3
    assert total("request_generation_tokens_count") == 4 and total("generation_tokens_total") == 4 * 3
    assert total("request_params_n_sum") == 4 and total("request_params_max_tokens_sum") == 3 * 3
    assert total("iteration_tokens_total_count", role="colocated") > 0
    assert total("prefix_cache_hits_total", role="colocated") > 0  # the third prompt is the second's
    assert total("cache_config_info", role="colocated", block_size="16", enable_prefix_caching="True") == 1
