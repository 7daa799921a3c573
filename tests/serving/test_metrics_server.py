"""The workers' /metrics keeps the `tandem:` names whatever the scraper negotiates (the router's /metrics does too)."""
from __future__ import annotations

import http.client

import pytest
from prometheus_client import Gauge

from serving.metrics import start_metrics_server

_PROBE = Gauge("tandem:metrics_server_probe", "A gauge only this test sets.")

# The Accept headers real scrapers send: Prometheus 2.x (OpenMetrics first), Prometheus 3.x (with escaping), none.
# (tests/e2e/test_prometheus_e2e.py records the one Debian's Prometheus really sends.)
ACCEPT = {
    "prometheus-2": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "prometheus-3": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
                    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;"
                    "escaping=allow-utf-8;q=0.3,text/plain;version=0.0.4;q=0.2,*/*;q=0.1",
    # 3.x with PrometheusProto first (native histograms on)
    "prometheus-3-proto": "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
                          "encoding=delimited;q=0.5,application/openmetrics-text;version=1.0.0;"
                          "escaping=allow-utf-8;q=0.4,application/openmetrics-text;version=0.0.1;q=0.3,"
                          "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.2,text/plain;version=0.0.4;q=0.1,"
                          "*/*;q=0.0",
    "none": None,
}


@pytest.fixture(scope="module")
def server():
    srv = start_metrics_server(_free_port(), "127.0.0.1")
    yield srv
    srv.shutdown()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("scraper", list(ACCEPT))
def test_samples_keep_their_colon_names(server, scraper):
    _PROBE.set(7)
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.request("GET", "/metrics", headers={"Accept": ACCEPT[scraper]} if ACCEPT[scraper] else {})
    r = conn.getresponse()
    body = r.read().decode()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/plain; version=0.0.4")
    assert "tandem:metrics_server_probe 7.0" in body.splitlines()
    assert not [line for line in body.splitlines() if line.startswith("tandem_")]


def test_other_paths_are_404(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.request("GET", "/nope")
    assert conn.getresponse().status == 404


def test_port_zero_serves_nothing():
    assert start_metrics_server(0) is None
