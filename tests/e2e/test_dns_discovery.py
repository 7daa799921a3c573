"""Discovery by DNS end to end: a real DNS server (dnsmasq on 127.0.0.1, tests/dnsmasq.py) answers a name with
several loopback addresses, a decode worker listens on each (127.0.0.2, .3, .4: one port, as the pods of a
headless service), and the router and the prefill worker are given the name (`--decode name:port`,
`--decode-allowlist name:port`, `--dns-server`). Requests go to the addresses the name has; when the records change
(the hosts file rewritten, dnsmasq reloaded), the instance that vanished gets no new requests and the one that
appeared gets them; an empty answer leaves no decode instance (health 503); when the DNS server is gone the router
keeps the last addresses it had and says so. Every wait polls for its condition."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from dnsmasq import DOMAIN, Dnsmasq, needs_dnsmasq
from ports import free_ports
from protos.tandem.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

pytestmark = [pytest.mark.slow, needs_dnsmasq]
ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 480  # five processes importing torch at once on a busy machine
WAIT_S = 60  # for a change to show: a few refresh intervals and polls, on a busy machine
NAME = f"decode.{DOMAIN}"
HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
REFRESH = ["--dns-refresh-interval", "0.3"]
ENGINE = ["--model", "random:tiny", "--device", "cpu", "--kv-cache-memory", "0.03125", "--max-model-len", "256"]


class Procs:
    def __init__(self, workdir: Path):
        self.workdir, self.procs, self.logs = workdir, {}, {}

    def start(self, name: str, argv: list[str]) -> None:
        self.logs[name] = self.workdir / f"{name}.log"
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "cli", *argv], cwd=ROOT, stdout=self.logs[name].open("w"),
            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})

    def log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def tail(self) -> str:
        return "\n".join(f"== {k}\n" + "".join(self.log(k).splitlines(True)[-25:]) for k in self.logs)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _last_answer(log: str, entry: str) -> str | None:
    """What a process last logged `entry` resolving to (serving/discovery.py's lines): its addresses, "" for an
    empty answer, None if it logged neither."""
    found = re.findall(rf"{re.escape(entry)}(?: resolves to ([^\n]+)|(: no addresses))", log)
    return None if not found else found[-1][0]


def _until(condition, what: str, procs: Procs, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (dead := [n for n, p in procs.procs.items() if p.poll() is not None]):
            raise AssertionError(f"{dead} exited while waiting for {what}:\n{procs.tail()}")
        if (result := condition()):
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}:\n{procs.tail()}")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    work = tmp_path_factory.mktemp("dns-mesh")
    dns = Dnsmasq(work, {NAME: HOSTS[:2]})
    grpc_port, http_port, prefill_port, decode_port, *metrics = free_ports(4 + len(HOSTS))
    procs = Procs(work)
    entry = f"{NAME}:{decode_port}"
    try:
        for host, mport in zip(HOSTS, metrics):
            procs.start(host, ["decode", "--host", host, "--port", str(decode_port), "--metrics-port", str(mport),
                               *ENGINE])
        procs.start("prefill", ["prefill", "--port", str(prefill_port), "--decode-allowlist", entry,
                                "--dns-server", dns.address, *REFRESH, *ENGINE])
        procs.start("router", ["router", "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                               "--prefill", f"127.0.0.1:{prefill_port}", "--decode", entry, "--dns-server",
                               dns.address, *REFRESH, "--model", "random:tiny", "--max-model-len", "256"])
        m = {"dns": dns, "procs": procs, "http": f"http://127.0.0.1:{http_port}", "port": decode_port,
             "prefill": f"127.0.0.1:{prefill_port}", "metrics": dict(zip(HOSTS, metrics))}
        _until(lambda: _health(m) == 200 and all(_up(m, h) for h in HOSTS[:2]), "the router's first instances",
               procs, READY_TIMEOUT_S)
        yield m
    finally:
        procs.stop()
        dns.stop()


def _health(m) -> int:
    try:
        return httpx.get(m["http"] + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return 0


def _where(m, host: str) -> str:
    return f"decode {host}:{m['port']} ({NAME}:{m['port']})"


def _up(m, host: str) -> bool:
    return f"{_where(m, host)} is up" in m["procs"].log("router")


def _served(m, host: str) -> float:
    """Requests the decode worker on host finished (its own /metrics)."""
    text = httpx.get(f"http://{host}:{m['metrics'][host]}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(r'^tandem:request_success_total\{[^}]*role="decode"[^}]*\} (\S+)$', text,
                                            re.M))


def _complete(m, n: int) -> None:
    for i in range(n):  # one at a time: round_robin takes the healthy decode instances in turn
        r = httpx.post(m["http"] + "/v1/completions", timeout=60, json={
            "model": "random:tiny", "prompt": [5 + i, 17, 99, 250] * 3, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6


def _gauge(m, state: str) -> float:
    text = httpx.get(m["http"] + "/metrics", timeout=5).text
    found = re.search(r'^tandem:router_instances\{[^}]*instance_role="decode"[^}]*state="%s"[^}]*\} (\S+)$' % state,
                      text, re.M)
    return float(found.group(1)) if found else -1.0


def test_requests_follow_the_names_records(mesh):
    m, procs = mesh, mesh["procs"]
    a, b, c = HOSTS
    _complete(m, 4)
    assert _served(m, a) >= 1 and _served(m, b) >= 1 and _served(m, c) == 0
    assert _gauge(m, "healthy") == 2

    m["dns"].set({NAME: [b, c]})  # a's pod went away, c's came up
    _until(lambda: f"{_where(m, a)} left DNS" in procs.log("router") and _up(m, c), "a to leave and c to join",
           procs)
    before = {h: _served(m, h) for h in HOSTS}
    _complete(m, 4)
    after = {h: _served(m, h) for h in HOSTS}
    assert after[a] == before[a], "no new request goes to an instance that left"
    assert after[b] > before[b] and after[c] > before[c], (before, after)
    _until(lambda: _gauge(m, "leaving") == 0 and _gauge(m, "healthy") == 2, "a's channel to close", procs)
    assert procs.log("router").count(f"{_where(m, a)} left DNS") == 1


def test_the_prefill_allowlist_follows_the_name_too(mesh):
    async def prefill(address: str):
        async with grpc.aio.insecure_channel(mesh["prefill"]) as ch:
            try:
                await prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
                    request_id="dns-allow", prompt_token_ids=[1, 2, 3], params=common_pb2.SamplingParams(max_tokens=4),
                    decode_address=address), timeout=30).read()
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
            return "OK"

    code, details = asyncio.run(prefill(f"127.0.0.9:{mesh['port']}"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"--decode-allowlist: {NAME}:{mesh['port']} = " in details, details


def test_an_empty_answer_leaves_no_decode_instance_and_a_lost_server_keeps_the_last_ones(mesh):
    m, procs = mesh, mesh["procs"]
    b, c = HOSTS[1:]
    m["dns"].set({})  # NXDOMAIN: no pod is ready
    _until(lambda: _health(m) == 503, "health 503 without decode instances", procs)
    assert f"decode {NAME}:{m['port']}: no addresses" in procs.log("router")
    m["dns"].set({NAME: [b, c]})
    _until(lambda: _health(m) == 200, "health 200 with the instances back", procs)
    # The prefill's allowlist re-resolves on a timer of its own: it may have seen the empty answer too, and must
    # have the records back before the server goes (else it keeps the empty set, as it should).
    entry, back = f"{NAME}:{m['port']}", f"{b}:{m['port']}, {c}:{m['port']}"
    _until(lambda: _last_answer(procs.log("prefill"), entry) == back, "the prefill's allowlist to see b and c",
           procs)

    m["dns"].stop()  # the DNS server is gone: lookups fail, the router keeps b and c
    _until(lambda: "lookup failed" in procs.log("router"), "the router to say its lookups fail", procs)
    assert "keeping its last 2 address(es)" in procs.log("router")
    _complete(m, 2)
    assert _health(m) == 200
