"""The router's liveness against its readiness, with a real router process whose every instance is down: `/livez`
answers 200 (the process is alive; Kubernetes must not restart it) while `/health` answers 503 (no instance to serve
with; take it out of the load balancer). A liveness probe on /health would restart every router during a worker
outage (deploy/kubernetes/)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ports import free_ports

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120


@pytest.mark.slow
def test_livez_is_200_while_every_instance_is_down_and_health_is_503():
    # Nothing listens on `dead`: every poll of the instances fails.
    http_port, grpc_port, dead = free_ports(3)
    router = subprocess.Popen([sys.executable, "-m", "cli", "router", "--model", "random:tiny",
                               "--http-port", str(http_port), "--grpc-port", str(grpc_port),
                               "--prefill", f"127.0.0.1:{dead}", "--decode", f"127.0.0.1:{dead}"],
                              cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        live = None
        with httpx.Client(base_url=base, timeout=10) as c:
            while live is None:
                assert router.poll() is None, router.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, f"no answer on {base}/livez in {START_TIMEOUT_S} s"
                try:
                    live = c.get("/livez")
                except httpx.TransportError:
                    time.sleep(0.2)
            health = c.get("/health")
            # (after a few of the router's 1 s health polls, so /health is not 503 only for want of a first poll)
            polls_later = time.monotonic() + 3
            while time.monotonic() < polls_later:
                assert c.get("/livez").status_code == 200
                time.sleep(0.5)
            health_later = c.get("/health")
        assert live.status_code == 200 and live.json() == {"status": "ok"}, live.text
        for h in (health, health_later):
            assert h.status_code == 503 and h.json()["status"] == "unavailable", h.text
    finally:
        router.terminate()
        router.wait(timeout=60)
